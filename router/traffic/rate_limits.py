"""Per-tenant rate limits shared by active-active routers through Redis (issue 33). Does I/O.

The limiter is the one the measurement picked (``loadtest.bench.rate_limit``: one Lua script on
the project's redis-py asyncio client against the ``limits`` library's moving window and sliding
window counter). ``TenantRateLimits`` is the request path's gate: a generation, pooling or
scoring request over its tenant's limits is a 429 ``RateLimitError`` with ``Retry-After``; when
Redis does not answer within ``CHECK_TIMEOUT_S`` the request is served (fail open) and counted.

A tenant's limits are requests per minute and tokens per minute (0: none). The rule is a moving
window (a sliding log, as ``limits.MovingWindowRateLimiter``): a request is let through when
what the tenant was let through in the last 60 s plus the request stays within the limit, for
both limits at once; so over any 60 s no more than the limit is let through, from a cold start
too (the sliding window counter this replaces let up to 1.5x through in the first minute of a
steady load, up to 2x in a minute after a burst at the end of its fixed window). Per tenant and limit, one sorted set:
an entry per request let through, scored by its time (ms on Redis's clock: ``TIME``, so routers
with skewed clocks share one window) with member ``"<running total>:<amount>"`` (the amount
counted up to and including it, zero-padded to 15 digits so that entries of one millisecond
sort in the order they came; and its own: a request's tokens are one entry, not one per token).
Expired entries are removed as each check begins, so the window's total is the newest running
total less the oldest entry's base, each entry is added and removed once (amortised O(log n) a
check), and a refusal finds when enough will have expired from the running totals (the request
log's entry by its rank, the token log's by a binary search). One ``EVALSHA`` does the check
and the insertion atomically, for both limits: a request refused on tokens consumes no request.

Memory: a tenant's request log holds at most ``requests_per_min`` entries, its token log at
most one entry per request let through in a minute (at most ``tokens_per_min``: an entry is at
least one token); both keys expire 60 s after the tenant's last request let through.

``RateLimiter.check`` returns a ``RateVerdict``; ``retry_after_s`` of a refused request is when
enough of the window's oldest entries will have expired for it to fit (the whole window for a
request larger than its limit, which never fits).
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

# KEYS: the tenant's request log and token log (sorted sets, one hash tag: a Redis Cluster keeps
# them on one slot). ARGV: window ms, requests limit, tokens limit (0: none), tokens cost.
# Returns {allowed (0/1), retry-after in milliseconds}.
MOVING_WINDOW_LUA: Final = """
local w = tonumber(ARGV[1])
local limits = {tonumber(ARGV[2]), tonumber(ARGV[3])}
local costs = {1, tonumber(ARGV[4])}
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function parse(member)  -- "<running total>:<amount>"
  local total, amount = string.match(member, '^(%d+):(%d+)$')
  return tonumber(total), tonumber(amount)
end
local newest = {0, 0}  -- each log's running total
for i = 1, 2 do
  local last = redis.call('ZRANGE', KEYS[i], -1, -1, 'WITHSCORES')
  if last[1] then
    newest[i] = parse(last[1])
    -- should Redis's clock step back, time stands still: the logs stay in time order
    now = math.max(now, tonumber(last[2]))
  end
end
-- when the oldest entries whose running totals reach `need` will have left the window; `first`:
-- the oldest entry's running total, `unit`: every amount is 1 (the request log: its rank is known)
local function wait_ms(key, need, first, unit)
  local lo, hi = 0, redis.call('ZCARD', key) - 1
  if unit then lo = need - first; hi = lo end
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if parse(redis.call('ZRANGE', key, mid, mid)[1]) >= need then hi = mid else lo = mid + 1 end
  end
  local entry = redis.call('ZRANGE', key, lo, lo, 'WITHSCORES')
  return math.max(1, tonumber(entry[2]) + w - now)
end
local retry = 0
for i = 1, 2 do
  if limits[i] > 0 and costs[i] > 0 then
    -- keep an entry while now - score <= w: scores are whole milliseconds (floored), so an
    -- entry of the same millisecond as now - w may be under w old in true time (two routers let
    -- 405 of 400 tokens through within 2 s before this)
    redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', '(' .. (now - w))
    local used, total, amount = 0, 0, 0
    local first = redis.call('ZRANGE', KEYS[i], 0, 0)[1]
    if first then
      total, amount = parse(first)
      used = newest[i] - total + amount
    end
    if used + costs[i] > limits[i] then
      if costs[i] > limits[i] then
        retry = math.max(retry, w)  -- never fits
      else
        retry = math.max(retry, wait_ms(KEYS[i], newest[i] + costs[i] - limits[i], total, i == 1))
      end
    end
  end
end
if retry > 0 then return {0, retry} end
for i = 1, 2 do
  if limits[i] > 0 and costs[i] > 0 then
    -- zero-padded: entries of one millisecond sort by member, so in the order they came
    redis.call('ZADD', KEYS[i], now, string.format('%015d:%d', newest[i] + costs[i], costs[i]))
    redis.call('PEXPIRE', KEYS[i], w)
  end
end
return {1, 0}
"""


@dataclass(frozen=True, slots=True)
class RateVerdict:
    """``allowed``; else ``retry_after_s``, seconds until the request would fit."""

    allowed: bool
    retry_after_s: float = 0.0


class RateLimiter:
    """Checks requests against per-tenant limits in Redis (``MOVING_WINDOW_LUA``).

    ``client``: a redis-py asyncio client (``router.shared.redis_client.redis_client``);
    ``prefix``: the fleet's key prefix; ``window_s``: the limits' window (seconds > 0; the
    router's are per minute). Raises what redis-py raises when Redis is away
    (``router.shared.redis_client.redis_errors``): the caller fails open and counts it."""

    def __init__(self, client: Any, prefix: str, window_s: float = WINDOW_S) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be positive")
        self.client = client
        self.prefix = prefix
        self.window_ms = round(window_s * 1000)
        self._script = client.register_script(MOVING_WINDOW_LUA)

    def keys(self, tenant: str) -> list[str]:
        """The tenant's request log and token log (one hash tag: one Redis Cluster slot)."""
        base = f"{self.prefix}:ratelimit:{{{tenant}}}"  # "pr:ratelimit:{t}", as "pr:events"
        return [f"{base}:requests", f"{base}:tokens"]

    async def check(self, tenant: str, requests_per_min: int, tokens_per_min: int,
                    tokens: int) -> RateVerdict:
        """One request of ``tokens`` tokens by ``tenant``: let through (and counted) or not;
        the limits are per window (0: none)."""
        allowed, retry_ms = await self._script(
            keys=self.keys(tenant),
            args=[self.window_ms, requests_per_min, tokens_per_min, tokens])
        return RateVerdict(bool(allowed), retry_ms / 1000.0)


class RateLimited(RouterError):
    """429: the tenant is over its requests or tokens per minute; ``Retry-After`` (whole
    seconds, at least 1) says when the request would fit."""

    status, error_type = 429, "RateLimitError"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers[RETRY_AFTER_HEADER] = str(retry_after_s)


class RequestTooLarge(RouterError):
    """429 without ``Retry-After``: the request alone is over its tenant's tokens per minute,
    so it never fits (OpenAI answers such a request 429 "Request too large" too)."""

    status, error_type = 429, "RateLimitError"


class TenantRateLimits:
    """Per-tenant rate limits on the request path: ``default_*`` for every tenant, replaced per
    tenant by the tenant file's ``requests_per_min`` / ``tokens_per_min`` (``tenants``). Off
    (``enabled`` False) without ``redis_url`` or without any limit. The Redis client is made on
    first use (``make_client``: ``router.shared.redis_client.redis_client``). A request of more tokens than its tenant's
    tokens per minute can never be let through: it is refused at once (``RequestTooLarge``,
    429 without ``Retry-After``, as OpenAI answers "Request too large"), counted ``limited``,
    without a round trip to Redis."""

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
            "router_rate_limit_requests_total", "Generation, pooling and scoring requests checked against "
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
        ``RateLimited`` when over them, ``RequestTooLarge`` when ``tokens`` alone exceed the
        tokens per minute; serves (fails open, counted) when Redis does not answer in
        ``CHECK_TIMEOUT_S``."""
        if not self.enabled:
            return
        requests_per_min, tokens_per_min = self.limits_of(tenant)
        if not (requests_per_min or tokens_per_min):
            return
        if tokens_per_min and tokens > tokens_per_min:
            # no wait makes it fit: a Retry-After would only invite the same refusal again
            self.checks.labels("limited").inc()
            raise RequestTooLarge(f"request too large: {tokens} prompt tokens against a limit "
                                  f"of {tokens_per_min} tokens per minute; shorten the request")
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
