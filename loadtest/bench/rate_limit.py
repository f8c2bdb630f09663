"""Per-tenant rate limits in Redis, every contender in one run: ``router.traffic.rate_limits``
(a moving window: one Lua script on the project's redis-py asyncio client) against the
``limits`` library's async Redis storage, its moving window (redis-py and coredis clients) and
its sliding window counter (the rule the router used before). Per request: a
requests-per-minute and a tokens-per-minute limit. Against a throwaway ``redis-server`` on
loopback, for each:

- wall, client CPU and Redis CPU microseconds per request of 1,000 tokens (tokens limit 10M a
  minute), one at a time and 64 at once;
- how many of 150 requests it lets through under a limit of 100 a minute (100 is right);
- the most it lets through in any window from a cold start (limit 100 per 2 s window: one
  request, half a window later the rest of the limit at once, then twice the rate for two
  windows); 100 is right;
- Redis memory of one tenant held at its limits (1,000 requests and 1,000,000 tokens a
  minute, requests of 1,000 tokens), and wall, client and Redis CPU of its refused checks.

Does I/O.

    python -m loadtest.bench.rate_limit
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from loadtest.bench.admission_figures import Span, most_in_any_window
from loadtest.harness.redis_server import RedisServer
from router.traffic.rate_limits import RateLimiter

Check = Callable[[str, int], Awaitable[bool]]  # (tenant, tokens) -> allowed
# (requests limit, tokens limit (0: none), window s) -> a check under those limits
Contender = Callable[[int, int, float], Check]

BIG_TOKENS_LIMIT = 10_000_000  # tokens a minute: never binds in the cost figures
WORST_WINDOW_S = 2.0  # the worst-window figure's window
LIMIT = 100  # requests a window, for the let-through and worst-window figures
FULL_REQUESTS = 1_000  # the tenant held at its limits: requests a minute (of 1,000 tokens)


def lua_moving_window(url: str) -> Contender:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)

    def make(requests: int, tokens: int, window_s: float) -> Check:
        limiter = RateLimiter(client, f"bench-{window_s:g}:", window_s)

        async def check(tenant: str, cost: int) -> bool:
            return (await limiter.check(tenant, requests, tokens, cost)).allowed
        return check
    return make


def limits_contender(url: str, strategy: Literal["moving", "counter"],
                     implementation: Literal["redispy", "coredis"]) -> Contender:
    from limits import RateLimitItemPerSecond
    from limits.aio.storage import RedisStorage
    from limits.aio.strategies import MovingWindowRateLimiter, SlidingWindowCounterRateLimiter

    storage = RedisStorage(url.replace("redis://", "async+redis://"),
                           implementation=implementation)
    limiter = (MovingWindowRateLimiter(storage) if strategy == "moving"
               else SlidingWindowCounterRateLimiter(storage))

    def make(requests: int, tokens: int, window_s: float) -> Check:
        request_item = RateLimitItemPerSecond(requests, round(window_s))
        token_item = RateLimitItemPerSecond(tokens, round(window_s)) if tokens else None

        async def check(tenant: str, cost: int) -> bool:
            # two limits, two hits (each a round trip); not atomic together: a request refused
            # on tokens has already counted against requests
            if not await limiter.hit(request_item, tenant, "req"):
                return False
            return token_item is None or await limiter.hit(token_item, tenant, "tok", cost=cost)
        return check
    return make


async def redis_cpu_s(client: Any) -> float:
    """The Redis server's CPU seconds so far (user + system)."""
    info = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def cost_per_request(check: Check, name: str, client: Any, n: int = 2_000
                           ) -> dict[str, float]:
    """Wall, client CPU and Redis CPU us per request of 1,000 tokens, a tenant each (never
    refused), one at a time and 64 at once."""
    for i in range(50):  # connections, script loading
        await check(f"warm-{name}-{i}", 1)
    out: dict[str, float] = {}
    for label, at_once in (("seq", 1), ("par", 64)):
        gate = asyncio.Semaphore(at_once)

        async def one(i: int, label: str = label, gate: asyncio.Semaphore = gate) -> None:
            async with gate:
                await check(f"{label}-{name}-{i}", 1000)
        redis_cpu = await redis_cpu_s(client)
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(n)))
        out[f"{label}_wall_us"] = (time.perf_counter() - started) / n * 1e6
        out[f"{label}_cpu_us"] = (time.process_time() - cpu) / n * 1e6
        out[f"{label}_redis_cpu_us"] = (await redis_cpu_s(client) - redis_cpu) / n * 1e6
    return out


async def worst_window(check: Check, tenant: str) -> int:
    """From a cold start as a ``WORST_WINDOW_S`` window begins (the epoch's windows, where the
    router's previous script had them: Redis's clock and this process's are the host's; and
    the first request's, where ``limits``' counter has them), one request; half a window later
    ``LIMIT`` - 1 at once, then twice ``LIMIT`` a window for two windows. The most let through
    within any one window, as the client tells it (``LIMIT`` is right)."""
    await asyncio.sleep(-time.time() % WORST_WINDOW_S)
    spans: list[Span] = []

    async def one() -> None:
        sent = time.monotonic()
        if await check(tenant, 1):
            spans.append((sent, time.monotonic(), 1))
    await one()
    await asyncio.sleep(WORST_WINDOW_S / 2)
    for _ in range(LIMIT - 1):
        await one()
    started, period = time.monotonic(), WORST_WINDOW_S / (2 * LIMIT)
    for i in range(int(2 * WORST_WINDOW_S / period)):
        await asyncio.sleep(max(0.0, started + i * period - time.monotonic()))
        await one()
    return most_in_any_window(spans, WORST_WINDOW_S)


async def at_the_limits(check: Check, tenant: str, client: Any, n: int = 1_000
                        ) -> dict[str, float]:
    """One tenant filled to its limits (``FULL_REQUESTS`` requests of 1,000 tokens), then
    ``n`` more checks (all refused): Redis bytes of its keys (``MEMORY USAGE``), wall, client
    CPU and Redis CPU us per refused check."""
    for _ in range(FULL_REQUESTS):
        await check(tenant, 1000)
    keys = [k async for k in client.scan_iter(match=f"*{tenant}*")]
    memory = sum([await client.memory_usage(k, samples=0) or 0 for k in keys])
    redis_cpu = await redis_cpu_s(client)
    started, cpu = time.perf_counter(), time.process_time()
    refused = sum([not await check(tenant, 1000) for _ in range(n)])
    return {"keys": len(keys), "bytes": memory, "refused": refused,
            "refused_wall_us": (time.perf_counter() - started) / n * 1e6,
            "refused_cpu_us": (time.process_time() - cpu) / n * 1e6,
            "refused_redis_cpu_us": (await redis_cpu_s(client) - redis_cpu) / n * 1e6}


async def measure(name: str, make: Contender, client: Any) -> None:
    cost = await cost_per_request(make(100, BIG_TOKENS_LIMIT, 60.0), name, client)
    one_tenant = make(LIMIT, BIG_TOKENS_LIMIT, 60.0)
    allowed = sum([await one_tenant(f"one-tenant-{name}", 10) for _ in range(150)])
    worst = await worst_window(make(LIMIT, 0, WORST_WINDOW_S), f"worst-{name}")
    full = await at_the_limits(make(FULL_REQUESTS, 1000 * FULL_REQUESTS, 60.0),
                               f"full-{name}", client)
    print(f"{name}: per request (wall / client CPU / Redis CPU, us) one at a time "
          f"{cost['seq_wall_us']:.0f} / {cost['seq_cpu_us']:.0f} / {cost['seq_redis_cpu_us']:.0f}"
          f", 64 at once {cost['par_wall_us']:.0f} / {cost['par_cpu_us']:.0f} / "
          f"{cost['par_redis_cpu_us']:.0f} | 150 at {LIMIT}/min: {allowed} let through | most in "
          f"any {WORST_WINDOW_S:g} s window at {LIMIT}: {worst} | at its limits: "
          f"{full['bytes']:,} bytes in {full['keys']} keys, a refused check "
          f"{full['refused_wall_us']:.0f} / {full['refused_cpu_us']:.0f} / "
          f"{full['refused_redis_cpu_us']:.0f}", flush=True)


async def main() -> None:
    import redis.asyncio as aioredis

    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    with RedisServer() as server:
        client = aioredis.Redis.from_url(server.url)
        contenders: list[tuple[str, Contender]] = [
            ("moving window, Lua (ours)", lua_moving_window(server.url)),
            ("limits moving, redis-py", limits_contender(server.url, "moving", "redispy")),
            ("limits moving, coredis", limits_contender(server.url, "moving", "coredis")),
            ("limits counter, redis-py", limits_contender(server.url, "counter", "redispy")),
        ]
        for name, make in contenders:
            await measure(name, make, client)
        await client.aclose()
    print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
