"""Redis refusing one replica's writes for lack of memory (``maxmemory`` reached under
``noeviction``): how to tell (``is_oom``) and the writer's state while it lasts (``OomState``:
the flag, the event that ends a backoff wait early, the one warning line per interval). No I/O
but logging; the writer (``worker/redis_writer.py``) decides when the state starts and ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Final

from redis.exceptions import OutOfMemoryError, ResponseError

from router.shared.logs import IntervalLog

logger = logging.getLogger("worker.redis_writer")  # the writer's lines, as before the split

OOM_BACKOFF_BASE_S: Final = 0.5  # first wait after Redis refused a write for lack of memory
OOM_BACKOFF_CAP_S: Final = 10.0  # longest wait between two write attempts under OOM
OOM_LOG_INTERVAL_S: Final = 10.0  # one OOM warning line per this many seconds
_OOM_MARK: Final = "OOM command not allowed"  # Redis's error, also inside a script's error


def is_oom(exc: BaseException) -> bool:
    """True when Redis refused a command for lack of memory (``maxmemory`` reached, policy
    ``noeviction``): redis-py's ``OutOfMemoryError``, or a script's error wrapping Redis's
    ``-OOM`` reply (a ``ResponseError`` naming it)."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and _OOM_MARK in str(exc))


class OomState:
    """Whether Redis refuses replica ``replica_id``'s writes (``active``), until a write goes
    through; its warning is logged at most once per ``OOM_LOG_INTERVAL_S`` and its end only
    for an episode whose start was."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.active = False
        self.writable = asyncio.Event()  # set when Redis accepts writes again
        self._log = IntervalLog(logger, OOM_LOG_INTERVAL_S)
        self._logged = False  # this episode's start was logged: so will its end be
        self._wait_s = OOM_BACKOFF_BASE_S

    def refused(self, exc: BaseException) -> None:
        """Redis refused a write for lack of memory: the state starts (or goes on)."""
        self.active = True
        self.writable.clear()
        # no reset per episode: episodes that follow within the interval share its one line
        self._logged |= self._log.warning("Redis is out of memory (maxmemory reached; run maxmemory-policy "
                          "noeviction with room for the fleet, see docs/worker.md): writes of "
                          "replica %s refused, its changes held and retried (%s)",
                          self.replica_id, exc)

    def over(self, num_refusals: int) -> bool:
        """A write went through with nothing left held: True if that ended the state."""
        was = self.active
        if was:
            if self._logged:
                logger.warning("Redis accepts writes again after being out of memory (%d "
                               "writes refused so far); replica %s's held changes sent",
                               num_refusals, self.replica_id)
            self._logged = False
            self.writable.set()
        self.active = False
        return was

    def probe_passed(self, holding: bool, num_refusals: int) -> bool:
        """A heartbeat's plain form went through: True (the flush loop retries at once) if the
        state was on. It ends here only if nothing is ``holding`` (else when the held changes
        flush: Redis near its limit may accept the small HSET and still refuse them)."""
        if not self.active:
            return False
        if holding:
            self.writable.set()
            return True
        return self.over(num_refusals)

    async def back_off(self) -> None:
        """Wait before the next write attempt: 0.5 s doubling to ``OOM_BACKOFF_CAP_S``, ended
        early by ``writable`` (a heartbeat Redis accepted in its plain form)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.writable.wait(), self._wait_s)
        self._wait_s = min(self._wait_s * 2, OOM_BACKOFF_CAP_S)

    def reset_backoff(self) -> None:
        """A flush went through: the next refusal waits the base time again."""
        self._wait_s = OOM_BACKOFF_BASE_S
