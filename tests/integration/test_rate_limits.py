"""The per-tenant rate limiter's Lua script (``router.traffic.rate_limits``) on a real Redis:
limits hold across clients (as across routers), per tenant, a request refused on tokens counts
nothing, and a refusal says when to retry. Not yet wired into the router (issue 33, step 2)."""

from __future__ import annotations

import asyncio

from router.traffic.rate_limits import WINDOW_S, RateLimiter


async def _run(url: str) -> None:
    import redis.asyncio as aioredis

    clients = [aioredis.Redis.from_url(url) for _ in range(2)]  # two routers' connections
    try:
        limiters = [RateLimiter(c, "test:") for c in clients]
        verdicts = [await limiters[i % 2].check("tenant-a", 100, 0, 7) for i in range(150)]
        assert sum(v.allowed for v in verdicts) == 100  # shared: 100 in all, not 100 each
        refused = [v for v in verdicts if not v.allowed]
        assert all(0 < v.retry_after_s <= WINDOW_S for v in refused)
        assert (await limiters[0].check("tenant-b", 100, 0, 7)).allowed  # another tenant's own

        # tokens: 1,000 a minute; a 600-token request fits once, the second is refused and
        # leaves the request count untouched (an atomic check of both limits)
        assert (await limiters[0].check("tenant-c", 2, 1000, 600)).allowed
        second = await limiters[1].check("tenant-c", 2, 1000, 600)
        assert not second.allowed and second.retry_after_s > 0
        assert (await limiters[1].check("tenant-c", 2, 1000, 400)).allowed  # the 2nd request
        assert not (await limiters[0].check("tenant-c", 2, 1000, 0)).allowed  # the 3rd: no
    finally:
        for c in clients:
            await c.aclose()


def test_limits_are_shared_per_tenant_and_atomic(redis_url: str) -> None:
    asyncio.run(_run(redis_url))


def test_no_limit_lets_everything_through(redis_url: str) -> None:
    import redis.asyncio as aioredis

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        limiter = RateLimiter(client, "test:")
        try:
            assert all([(await limiter.check("t", 0, 0, 10**6)).allowed
                        for _ in range(20)])
        finally:
            await client.aclose()
    asyncio.run(run())
