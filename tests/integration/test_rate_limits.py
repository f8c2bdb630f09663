"""The per-tenant rate limiter's Lua script (``router.traffic.rate_limits``) on a real Redis:
limits hold across clients (as across routers), per tenant, a request refused on tokens counts
nothing, and a refusal says when to retry; and through two real router processes sharing one
Redis: one limit for both, 429 with Retry-After, served and counted when Redis is away."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loadtest.harness.redis_server import RedisServer
from router.traffic.rate_limits import WINDOW_S, RateLimiter
from tests.helpers import wait_for
from tests.integration.test_router_admission import BODY, HoldingReplica, replicas, sample
from tests.integration.test_router_fleet import Router

__all__ = ["replicas"]  # the fixture, shared

pytestmark = pytest.mark.timeout(240)


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


def _limited_router(tmp: Path, replica: HoldingReplica, redis_url: str, name: str,
                    *flags: str) -> Router:
    router = Router(tmp, ["--replica", replica.url, "--redis-url", redis_url, *flags], name=name)
    wait_for(lambda: any(r["routable"] for r in router.ready()["replicas"]), 30,
             message="replica routable", procs=[router.proc])
    return router


def test_two_routers_share_one_tenant_limit(replicas: list[HoldingReplica], redis_url: str,
                                            tmp_path: Path) -> None:
    replica = replicas[0]
    replica.release()
    routers = [_limited_router(tmp_path, replica, redis_url, f"router-{i}",
                               "--rate-limit-requests-per-min", "60") for i in range(2)]
    try:
        answers = [routers[i % 2].post("/v1/completions", BODY) for i in range(120)]
        served = [a for a in answers if a[0] == 200]
        limited = [a for a in answers if a[0] == 429]
        assert len(served) + len(limited) == 120
        # one limit for both routers: 60 a minute in all (within 10%), not 60 each
        assert 54 <= len(served) <= 66, len(served)
        for _, headers, body in limited:
            assert 1 <= int(headers["retry-after"]) <= 60
            assert json.loads(body)["error"]["type"] == "RateLimitError"
        counted = sum(sample(r.metrics(), "router_rate_limit_requests_total", outcome="limited")
                      for r in routers)
        assert counted == len(limited)
    finally:
        for r in routers:
            r.stop()


def test_redis_away_the_request_is_served_and_counted(replicas: list[HoldingReplica],
                                                      tmp_path: Path) -> None:
    replica = replicas[0]
    replica.release()
    with RedisServer() as server:
        router = _limited_router(tmp_path, replica, server.url, "router",
                                 "--rate-limit-requests-per-min", "1")
        try:
            assert router.post("/v1/completions", BODY)[0] == 200
            assert router.post("/v1/completions", BODY)[0] == 429
            server.stop()
            for _ in range(3):
                status, _, body = router.post("/v1/completions", BODY)
                assert status == 200, body
            assert sample(router.metrics(), "router_rate_limit_requests_total",
                          outcome="fail_open") == 3
        finally:
            router.stop()
