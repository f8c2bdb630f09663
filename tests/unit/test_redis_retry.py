"""The reconnect loops of the router's stream reader and the worker's writer run on redis-py's
own ``Retry`` with ``ExponentialBackoff`` (``router.shared.redis_client.reconnect_retry``): forever on
Redis and socket errors, 0.1 s doubling to the cap, other errors and cancellation through."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from redis.asyncio.retry import Retry
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from router.shared.redis_client import reconnect_retry


async def test_retries_redis_and_socket_errors_with_doubling_waits() -> None:
    retry = reconnect_retry(base_s=0.05, cap_s=0.2)
    assert isinstance(retry, Retry)
    errors = [RedisConnectionError("refused"), ConnectionResetError("reset"),
              ResponseError("READONLY You can't write against a read only replica"),
              TimeoutError("slow")]
    seen: list[tuple[str, float]] = []
    started = time.monotonic()

    async def attempt() -> str:
        if errors:
            raise errors.pop(0)
        return "ok"

    async def failed(exc: Exception) -> None:
        seen.append((type(exc).__name__, time.monotonic() - started))

    assert await retry.call_with_retry(attempt, failed) == "ok"
    assert [name for name, _ in seen] == ["ConnectionError", "ConnectionResetError",
                                          "ResponseError", "TimeoutError"]
    waits = [b[1] - a[1] for a, b in itertools.pairwise(seen)]
    # 0.1 s, 0.2 s (the cap), 0.2 s between the failures
    assert waits[0] >= 0.09 and waits[1] >= 0.19 and waits[2] >= 0.19
    # the cap, from the backoff itself (a wall-clock upper bound would time the machine)
    assert [retry._backoff.compute(n) for n in (1, 2, 3, 10)] == [0.1, 0.2, 0.2, 0.2]


async def test_other_errors_and_cancellation_pass_through() -> None:
    retry = reconnect_retry()
    calls = 0

    async def bad_input() -> None:
        nonlocal calls
        calls += 1
        raise ValueError("not a Redis failure")

    async def failed(exc: Exception) -> None:
        raise AssertionError("no retry expected")

    with pytest.raises(ValueError):
        await retry.call_with_retry(bad_input, failed)
    assert calls == 1
    task = asyncio.ensure_future(retry.call_with_retry(lambda: asyncio.sleep(60), failed))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
