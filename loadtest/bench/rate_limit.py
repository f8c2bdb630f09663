"""Per-tenant rate limits in Redis: the ``limits`` library's async Redis storage (sliding window
counter, its redis-py and coredis clients) against ``router.traffic.rate_limits`` (one Lua
script on the project's redis-py asyncio client). Per request: a requests-per-minute and a
tokens-per-minute limit. Wall and CPU microseconds per request, one at a time and 64 at once,
against a throwaway ``redis-server`` on loopback; and how many of 150 requests each lets
through under a limit of 100 per minute (both must say 100). Does I/O.

    python -m loadtest.bench.rate_limit
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal

from loadtest.harness.redis_server import RedisServer
from router.traffic.rate_limits import RateLimiter

Check = Callable[[str, int], Awaitable[bool]]  # (tenant, tokens) -> allowed


def lua_check(url: str) -> Check:
    import redis.asyncio as aioredis

    limiter = RateLimiter(aioredis.Redis.from_url(url), "bench:")

    async def check(tenant: str, tokens: int) -> bool:
        return (await limiter.check(tenant, 100, 10_000_000, tokens)).allowed
    return check


def limits_check(url: str, implementation: Literal["redispy", "coredis"]) -> Check:
    from limits import RateLimitItemPerMinute
    from limits.aio.storage import RedisStorage
    from limits.aio.strategies import SlidingWindowCounterRateLimiter

    storage = RedisStorage(url.replace("redis://", "async+redis://"),
                           implementation=implementation)
    limiter = SlidingWindowCounterRateLimiter(storage)
    requests, tokens_item = RateLimitItemPerMinute(100), RateLimitItemPerMinute(10_000_000)

    async def check(tenant: str, tokens: int) -> bool:
        # two limits, two hits (each a round trip); not atomic together: a request refused on
        # tokens has already counted against requests
        return (await limiter.hit(requests, tenant, "req")
                and await limiter.hit(tokens_item, tenant, "tok", cost=tokens))
    return check


async def measure(name: str, check: Check, n: int = 2_000) -> None:
    for i in range(50):  # connections, script loading
        await check(f"warm-{name}-{i}", 1)
    started, cpu = time.perf_counter(), time.process_time()
    for i in range(n):
        await check(f"seq-{name}-{i}", 1000)  # a tenant each: never refused, every path the same
    seq_wall = (time.perf_counter() - started) / n * 1e6
    seq_cpu = (time.process_time() - cpu) / n * 1e6
    started, cpu = time.perf_counter(), time.process_time()
    gate = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with gate:
            await check(f"par-{name}-{i}", 1000)
    await asyncio.gather(*(one(i) for i in range(n)))
    par_wall = (time.perf_counter() - started) / n * 1e6
    par_cpu = (time.process_time() - cpu) / n * 1e6
    allowed = sum([await check(f"one-tenant-{name}", 10) for _ in range(150)])
    print(f"{name:<22} one at a time: {seq_wall:7.1f} us wall {seq_cpu:7.1f} us CPU | "
          f"64 at once: {par_wall:7.1f} us wall {par_cpu:7.1f} us CPU per request | "
          f"150 at 100/min: {allowed} let through")


async def main() -> None:
    with RedisServer() as server:
        await measure("lua (redis-py)", lua_check(server.url))
        await measure("limits (redis-py)", limits_check(server.url, "redispy"))
        await measure("limits (coredis)", limits_check(server.url, "coredis"))


if __name__ == "__main__":
    asyncio.run(main())
