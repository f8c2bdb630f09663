"""Per-tenant rate limits shared by active-active routers through Redis (issue 33). Does I/O.

The limiter is the one the measurement picked (``loadtest.bench.rate_limit``: one Lua script on
the project's redis-py asyncio client against the ``limits`` library's async Redis storage).
``TenantRateLimits`` is the request path's gate: a completions or chat request over its
tenant's limits is a 429 ``RateLimitError`` with ``Retry-After``; when Redis does not answer
within ``CHECK_TIMEOUT_S`` the request is served (fail open) and counted.

A tenant's limits are requests per minute and tokens per minute (0: none). The rule is a
sliding window counter, the one ``limits.SlidingWindowCounterRateLimiter`` implements: per
tenant and limit, a counter for the current minute and one for the previous; a request is let
through when ``previous x (1 - elapsed / 60 s) + current + cost`` stays within the limit, for
both limits at once, and only then are both counters increased. One ``EVALSHA`` does the check
and the increments atomically on Redis's clock (``TIME``: the window keys are named by it), so
routers with skewed clocks share one window and a request refused on tokens consumes no request. Keys live two windows.

``RateLimiter.check`` returns a ``RateVerdict``; ``retry_after_s`` of a refused request is
when the weighted previous window will have decayed enough (or the current window ends).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import CollectorRegistry, Counter

from router.request.errors import RouterError
from router.shared.redis_client import redis_errors
from router.traffic.admission import RETRY_AFTER_HEADER
from router.traffic.classes import TenantTraffic

logger = logging.getLogger(__name__)

WINDOW_S: Final = 60  # the limits are per minute
CHECK_TIMEOUT_S: Final = 0.5  # a check Redis has not answered by then fails open
OUTCOMES: Final = ("allowed", "limited", "fail_open")

# KEYS: the tenant's base key (its window keys are built from it on Redis's clock: they share its
# hash tag, so a Redis Cluster keeps them on its slot). ARGV: window seconds, requests limit, tokens limit (0: none), tokens cost.
# Returns {allowed (0/1), retry-after in milliseconds}.
SLIDING_WINDOW_LUA: Final = """
local w = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local elapsed = now % w
local weight = 1 - elapsed / w
local win = math.floor(now / w)
local rcur, rprev = KEYS[1] .. ':req:' .. win, KEYS[1] .. ':req:' .. (win - 1)
local tcur, tprev = KEYS[1] .. ':tok:' .. win, KEYS[1] .. ':tok:' .. (win - 1)
local function estimate(cur, prev)
  local p = tonumber(redis.call('GET', prev) or '0')
  return p * weight + tonumber(redis.call('GET', cur) or '0'), p
end
local function wait_ms(est, prev, limit, cost)
  local excess = est + cost - limit
  local until_end = w - elapsed
  if prev > 0 then
    local x = excess * w / prev
    if x < until_end then return math.ceil(x * 1000) end
  end
  return math.ceil(until_end * 1000)
end
local retry = 0
local rlimit, tlimit, cost = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if rlimit > 0 then
  local est, prev = estimate(rcur, rprev)
  if est + 1 > rlimit then retry = math.max(retry, wait_ms(est, prev, rlimit, 1)) end
end
if tlimit > 0 then
  local est, prev = estimate(tcur, tprev)
  if est + cost > tlimit then retry = math.max(retry, wait_ms(est, prev, tlimit, cost)) end
end
if retry > 0 then return {0, retry} end
if rlimit > 0 then
  redis.call('INCRBY', rcur, 1)
  redis.call('EXPIRE', rcur, 2 * w)
end
if tlimit > 0 and cost > 0 then
  redis.call('INCRBY', tcur, cost)
  redis.call('EXPIRE', tcur, 2 * w)
end
return {1, 0}
"""


@dataclass(frozen=True, slots=True)
class RateVerdict:
    """``allowed``; else ``retry_after_s``, seconds until the request would fit."""

    allowed: bool
    retry_after_s: float = 0.0


class RateLimiter:
    """Checks requests against per-tenant limits in Redis (``SLIDING_WINDOW_LUA``).

    ``client``: a redis-py asyncio client (``router.shared.redis_client.redis_client``);
    ``prefix``: the fleet's key prefix. Raises what redis-py raises when Redis is away
    (``router.shared.redis_client.redis_errors``): the caller fails open and counts it."""

    def __init__(self, client: Any, prefix: str, window_s: int = WINDOW_S) -> None:
        self.client = client
        self.prefix = prefix
        self.window_s = window_s
        self._script = client.register_script(SLIDING_WINDOW_LUA)

    async def check(self, tenant: str, requests_per_min: int, tokens_per_min: int,
                    tokens: int) -> RateVerdict:
        """One request of ``tokens`` tokens by ``tenant``: let through (and counted) or not."""
        # one hash tag per tenant: a Redis Cluster keeps its window keys on one slot
        allowed, retry_ms = await self._script(
            keys=[f"{self.prefix}ratelimit:{{{tenant}}}"],
            args=[self.window_s, requests_per_min, tokens_per_min, tokens])
        return RateVerdict(bool(allowed), retry_ms / 1000.0)


class RateLimited(RouterError):
    """429: the tenant is over its requests or tokens per minute; ``Retry-After`` (whole
    seconds, at least 1) says when the request would fit."""

    status, error_type = 429, "RateLimitError"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers[RETRY_AFTER_HEADER] = str(retry_after_s)


class TenantRateLimits:
    """Per-tenant rate limits on the request path: ``default_*`` for every tenant, replaced per
    tenant by the tenant file's ``requests_per_min`` / ``tokens_per_min`` (``tenants``). Off
    (``enabled`` False) without ``redis_url`` or without any limit. The Redis client is made on
    first use (``make_client``: ``router.shared.redis_client.redis_client``)."""

    def __init__(self, default_requests_per_min: int, default_tokens_per_min: int,
                 tenants: Mapping[str, TenantTraffic], make_client: Any, prefix: str,
                 registry: CollectorRegistry, redis_url: str | None) -> None:
        self.default = (default_requests_per_min, default_tokens_per_min)
        self.tenants = {name: t for name, t in tenants.items()
                        if t.requests_per_min is not None or t.tokens_per_min is not None}
        self.enabled = redis_url is not None and (any(self.default) or any(
            t.requests_per_min or t.tokens_per_min for t in self.tenants.values()))
        self._make_client = make_client
        self._prefix = prefix
        self._limiter: RateLimiter | None = None
        self._errors: tuple[type[Exception], ...] = (TimeoutError, *redis_errors())
        self.checks = Counter(
            "router_rate_limit_requests_total", "Completions and chat requests checked against "
            "their tenant's rate limits, by outcome (allowed, limited: answered 429, fail_open: "
            "Redis did not answer and the request was served)", ["outcome"], registry=registry)
        for outcome in OUTCOMES:
            self.checks.labels(outcome)

    def limits_of(self, tenant: str) -> tuple[int, int]:
        """``(requests_per_min, tokens_per_min)`` of ``tenant`` (0: none)."""
        entry = self.tenants.get(tenant)
        if entry is None:
            return self.default
        return (self.default[0] if entry.requests_per_min is None else entry.requests_per_min,
                self.default[1] if entry.tokens_per_min is None else entry.tokens_per_min)

    async def check(self, tenant: str, tokens: int) -> None:
        """Count one request of ``tokens`` prompt tokens against ``tenant``'s limits. Raises
        ``RateLimited`` when over them; serves (fails open, counted) when Redis does not
        answer in ``CHECK_TIMEOUT_S``."""
        if not self.enabled:
            return
        requests_per_min, tokens_per_min = self.limits_of(tenant)
        if not (requests_per_min or tokens_per_min):
            return
        if self._limiter is None:
            self._limiter = RateLimiter(self._make_client(), self._prefix)
        try:
            verdict = await asyncio.wait_for(
                self._limiter.check(tenant, requests_per_min, tokens_per_min, tokens),
                CHECK_TIMEOUT_S)
        except self._errors as exc:
            self.checks.labels("fail_open").inc()
            logger.debug("rate limit check failed, request served: %r", exc)
            return
        if verdict.allowed:
            self.checks.labels("allowed").inc()
            return
        self.checks.labels("limited").inc()
        retry = max(1, math.ceil(verdict.retry_after_s))
        raise RateLimited(f"rate limit reached ({requests_per_min} requests, {tokens_per_min} "
                          f"tokens per minute; 0: none); retry after {retry} s", retry)
