"""Per-tenant rate limits shared by active-active routers through Redis (issue 33). Does I/O.

Not wired into the request path yet: this module is the limiter the measurement picked
(``loadtest.bench_rate_limit``: one Lua script on the project's redis-py asyncio client against
the ``limits`` library's async Redis storage).

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

from dataclasses import dataclass
from typing import Any, Final

WINDOW_S: Final = 60  # the limits are per minute

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
