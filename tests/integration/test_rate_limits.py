"""The per-tenant rate limiter's Lua script (``router.traffic.rate_limits``) on a real Redis:
limits hold across clients (as across routers), per tenant, a request refused on tokens counts
nothing, a refusal says when to retry, and no window of the limit's length ever lets more than
the limit through (requests and tokens), from a cold start in the middle of Redis's clock
minute too; and through two real router processes sharing one Redis: one limit for both over
any minute, 429 with Retry-After, served and counted when Redis is away."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest

from loadtest.bench.admission_figures import Span, most_in_any_window
from loadtest.harness.redis_server import RedisServer
from router.traffic.rate_limits import WINDOW_S, RateLimiter
from tests.helpers import wait_for
from tests.integration.test_router_admission import BODY, HoldingReplica, replicas, sample
from tests.integration.test_router_fleet import Router

__all__ = ["replicas"]  # the fixture, shared

pytestmark = pytest.mark.timeout(300)


async def _run(url: str) -> None:
    import redis.asyncio as aioredis

    clients = [aioredis.Redis.from_url(url) for _ in range(2)]  # two routers' connections
    try:
        limiters = [RateLimiter(c, "test") for c in clients]
        verdicts = [await limiters[i % 2].check("tenant-a", 100, 0, 7) for i in range(150)]
        assert sum(v.allowed for v in verdicts) == 100  # shared: 100 in all, not 100 each
        refused = [v for v in verdicts if not v.allowed]
        assert all(0 < v.retry_after_s <= WINDOW_S for v in refused)
        assert (await limiters[0].check("tenant-b", 100, 0, 7)).allowed  # another tenant's own
        # under the fleet's prefix as every other key (was "testratelimit:...": no separator)
        assert await clients[0].exists("test:ratelimit:{tenant-a}:requests") == 1

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
        limiter = RateLimiter(client, "test")
        try:
            assert all([(await limiter.check("t", 0, 0, 10**6)).allowed
                        for _ in range(20)])
        finally:
            await client.aclose()
    asyncio.run(run())


async def _redis_clock_s(client: Any) -> float:
    seconds, micros = await client.time()
    return float(seconds) + micros / 1e6


async def _start_mid_window(client: Any, window_s: float, phase: float) -> None:
    """Sleep until Redis's clock is ``phase`` (0-1) of the way through a ``window_s`` window
    counted from the epoch: where a fixed-window rule's current window is half spent."""
    at = (await _redis_clock_s(client)) % window_s
    await asyncio.sleep((phase * window_s - at) % window_s)


def test_no_window_lets_more_than_the_limit_through(redis_url: str) -> None:
    """Two clients (as two routers) on one tenant, window 2 s, 40 requests and 400 tokens a
    window; from a cold start half-way through Redis's window: the limit in one burst, then
    twice the request rate for 2.5 windows with costs 1, 5 and 30 (the token limit binds too).
    No 2 s lets more than 40 requests or 400 tokens through. (The sliding window counter let
    the burst through, then about 20 more requests by the end of that first window.)"""
    import redis.asyncio as aioredis

    window_s, max_requests, max_tokens = 2.0, 40, 400

    async def run() -> tuple[list[Span], list[Span], int]:
        clients = [aioredis.Redis.from_url(redis_url) for _ in range(2)]
        limiters = [RateLimiter(c, "test", window_s) for c in clients]
        requests: list[Span] = []
        tokens: list[Span] = []
        refused = 0

        async def one(i: int, cost: int) -> None:
            nonlocal refused
            sent = time.monotonic()
            verdict = await limiters[i % 2].check("t", max_requests, max_tokens, cost)
            if verdict.allowed:
                requests.append((sent, time.monotonic(), 1))
                tokens.append((sent, time.monotonic(), cost))
            else:
                assert 0 < verdict.retry_after_s <= window_s
                refused += 1
        try:
            await _start_mid_window(clients[0], window_s, 0.5)
            await asyncio.gather(*(one(i, 5) for i in range(max_requests)))
            costs = itertools.cycle((1, 5, 30))
            started, period = time.monotonic(), window_s / (2 * max_requests)
            for i in range(int(2.5 * window_s / period)):
                await asyncio.sleep(max(0.0, started + i * period - time.monotonic()))
                await one(i, next(costs))
        finally:
            for c in clients:
                await c.aclose()
        return requests, tokens, refused

    requests, tokens, refused = asyncio.run(run())
    assert refused > 0
    assert most_in_any_window(requests, window_s) <= max_requests
    assert most_in_any_window(tokens, window_s) <= max_tokens
    # and the limit is reached: what a window lets through is the limit, not less
    assert most_in_any_window(requests, window_s) >= 0.9 * max_requests


def test_a_refusal_fits_once_its_retry_after_has_passed(redis_url: str) -> None:
    """Tokens 1,000 a window (1 s): three requests of 300 fit, one of 500 is refused until the
    oldest two have left the window; its Retry-After says when, and then it fits. The same for
    3 requests a window (2 s): the fourth fits once the first has left, a fifth does not."""
    import redis.asyncio as aioredis

    async def run() -> None:
        client = aioredis.Redis.from_url(redis_url)
        limiter = RateLimiter(client, "test", 1.0)
        try:
            for _ in range(3):
                assert (await limiter.check("t", 0, 1000, 300)).allowed
            verdict = await limiter.check("t", 0, 1000, 500)
            assert not verdict.allowed and 0 < verdict.retry_after_s <= 1.0
            await asyncio.sleep(verdict.retry_after_s + 0.05)
            assert (await limiter.check("t", 0, 1000, 500)).allowed
            too_big = await limiter.check("u", 0, 1000, 1001)  # never fits: a whole window
            assert not too_big.allowed and too_big.retry_after_s == 1.0
            requests = RateLimiter(client, "test", 2.0)
            for _ in range(3):  # 0.6 s apart
                assert (await requests.check("r", 3, 0, 1)).allowed
                await asyncio.sleep(0.6)
            verdict = await requests.check("r", 3, 0, 1)
            assert not verdict.allowed and 0 < verdict.retry_after_s <= 2.0
            await asyncio.sleep(verdict.retry_after_s + 0.05)
            assert (await requests.check("r", 3, 0, 1)).allowed
            assert not (await requests.check("r", 3, 0, 1)).allowed  # the 2nd and 3rd remain
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


def test_two_routers_hold_the_limit_over_any_minute_from_a_cold_start(
        replicas: list[HoldingReplica], redis_url: str, tmp_path: Path) -> None:
    """30 requests and 600 prompt tokens a minute, through two routers on one Redis, from a
    cold start a quarter or more into Redis's clock minute: both limits in one burst (30
    requests of 20 tokens), then a request a second (twice the rate) alternating between the
    routers, of 10 and 40 tokens, for 62 s. No 60 s lets more than 30 requests or 600 tokens
    through. (The sliding window counter let 50 requests through in the first minute of one
    run: its next window opened with the burst's count decaying.)"""
    import redis

    replica = replicas[0]
    replica.release()
    max_requests, max_tokens = 30, 600
    routers = [_limited_router(tmp_path, replica, redis_url, f"router-{i}",
                               "--rate-limit-requests-per-min", str(max_requests),
                               "--rate-limit-tokens-per-min", str(max_tokens))
               for i in range(2)]
    requests: list[Span] = []
    tokens: list[Span] = []
    statuses: list[int] = []

    def one(i: int, cost: int) -> None:
        body = {**BODY, "prompt": list(range(1, cost + 1))}
        sent = time.monotonic()
        status, headers, _ = routers[i % 2].post("/v1/completions", body)
        statuses.append(status)
        if status == 200:
            requests.append((sent, time.monotonic(), 1))
            tokens.append((sent, time.monotonic(), cost))
        else:
            assert status == 429 and 1 <= int(headers["retry-after"]) <= WINDOW_S

    try:
        client = redis.Redis.from_url(redis_url)
        seconds, _ = client.time()
        client.close()
        if not 15 <= seconds % WINDOW_S <= 55:  # the counter let the least through near 0
            time.sleep((15 - seconds % WINDOW_S) % WINDOW_S)
        started = time.monotonic()
        for i in range(max_requests):
            one(i, max_tokens // max_requests)
        costs = itertools.cycle((10, 40))
        for i in itertools.count():
            at = started + 1.0 + i
            if at > started + WINDOW_S + 2:
                break
            time.sleep(max(0.0, at - time.monotonic()))
            one(i, next(costs))
    finally:
        for r in routers:
            r.stop()
    assert statuses.count(429) > 0
    assert most_in_any_window(requests, WINDOW_S) <= max_requests, statuses
    assert most_in_any_window(tokens, WINDOW_S) <= max_tokens, statuses


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


def test_pooling_paths_count_against_the_tenants_limits(replicas: list[HoldingReplica],
                                                        redis_url: str, tmp_path: Path) -> None:
    """Embeddings and scoring share the tenant's requests a minute with completions (a tenant
    held to 3 a minute got every embeddings request through before); the tokenizer paths are
    not counted."""
    replica = replicas[0]
    replica.release()
    router = _limited_router(tmp_path, replica, redis_url, "router",
                             "--rate-limit-requests-per-min", "3")
    try:
        assert router.post("/v1/completions", BODY)[0] == 200
        for path, body in (("/v1/embeddings", {"model": "fixed", "input": "a text"}),
                           ("/rerank", {"model": "fixed", "query": "q", "documents": ["d"]})):
            status, _, answer = router.post(path, body)
            assert status != 429, (path, answer)  # forwarded (this replica serves neither)
        for path in ("/v1/embeddings", "/score", "/v1/completions"):
            status, headers, answer = router.post(
                path, BODY if path == "/v1/completions" else {"model": "fixed", "input": "x"})
            assert status == 429, (path, answer)
            assert json.loads(answer)["error"]["type"] == "RateLimitError"
            assert 1 <= int(headers["retry-after"]) <= WINDOW_S
        status, _, answer = router.post("/tokenize", {"model": "fixed", "prompt": "x"})
        assert status != 429, answer
        metrics = router.metrics()
        assert sample(metrics, "router_rate_limit_requests_total", outcome="limited") == 3
        # the refusals are requests finished too (they were missing from the pooling paths')
        for path in ("/v1/embeddings", "/score"):
            assert sample(metrics, "router_requests_total", endpoint=path, status="429") == 1
    finally:
        router.stop()


def test_a_request_over_the_whole_token_limit_is_refused_without_retry_after(
        replicas: list[HoldingReplica], redis_url: str, tmp_path: Path) -> None:
    """A prompt larger than its tenant's tokens a minute never fits: 429 "request too large"
    at once, no Retry-After (it was told to retry after 60 s, to be refused again), nothing
    counted against the window (the next request that fits is served)."""
    replica = replicas[0]
    replica.release()
    router = _limited_router(tmp_path, replica, redis_url, "router",
                             "--rate-limit-tokens-per-min", "100")
    try:
        status, headers, answer = router.post(
            "/v1/completions", {**BODY, "prompt": list(range(1, 202))})
        assert status == 429, answer
        assert "retry-after" not in headers
        error = json.loads(answer)["error"]
        assert error["type"] == "RateLimitError" and "too large" in error["message"]
        status, headers, answer = router.post(
            "/v1/embeddings", {"model": "fixed", "input": [list(range(1, 150))]})
        assert status == 429 and "retry-after" not in headers, answer
        # Cohere's mixed inputs: counted as any other input (they counted 1 token)
        status, headers, answer = router.post("/v2/embed", {"model": "fixed", "inputs": [
            {"content": [{"type": "text", "text": "word " * 200}]}]})
        assert status == 429 and "retry-after" not in headers, answer
        assert router.post("/v1/completions", {**BODY, "prompt": list(range(1, 90))})[0] == 200
    finally:
        router.stop()
