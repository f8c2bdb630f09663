"""How late the router's own event loop ran, so that timeouts measured on it are not blamed on a
replica. asyncio only.

Every timeout the router judges a replica by (the connect timeout, the first-byte deadline and
timeout, the stall timeout, a half-open probe's) is timed on the router's event loop. A loop
starved of CPU (1,000 streams on a saturated 2-core machine) runs every callback late: a
connection the kernel completed in a millisecond is seen seconds later, after its timer fired,
and every replica looks failed at once (issue 29: all four circuits opened within 100 ms on
``connect_timeout``).

``LoopLag.run`` sleeps ``SAMPLE_S`` in a loop and adds up how late each wake-up came (the time
the loop was too busy to run a callback that was due). The rule (``LoopLag.late``): a timeout
over the span ``[since, now]`` says nothing about the replica when the loop's lateness summed
over that span is at least ``LATE_SHARE`` of it: the router then had the replica's answer, or
could have had it, for a good part of the time it blamed the replica for.

Two uses go further than a verdict: ``LagTolerantTimeout`` (the upstream connect timeout) gives
back the time the loop lost when it falls due, so a connect the kernel completed while the loop
was busy elsewhere is seen on the next turn instead of cancelled and made again; and
``LoopLag.overloaded`` (the loop late for most of the last second while its timers fall due
late) lets the router shed new requests at once instead of after timeouts it cannot time.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections import deque
from types import TracebackType
from typing import Final

SAMPLE_S: Final = 0.05  # one wake-up every 50 ms: 20 cheap callbacks a second
LATE_SHARE: Final = 0.25  # a span whose loop lateness is this share of it was the router's fault
MIN_LATE_S: Final = 0.002  # a wake-up later than this is recorded (below it: scheduling noise)
MAX_POINTS: Final = 32_768  # late wake-ups kept (27 min of a loop late on every wake-up)
# a connect timer (LagTolerantTimeout) waits at most this many connect timeouts in all, however
# late the loop ran (the late retries it replaces allowed 1 + 3)
MAX_CONNECT_TIMEOUTS: Final = 4
SHED_WINDOW_S: Final = 1.0  # ``overloaded``: the loop late for most (SHED_SHARE) of this window
SHED_SHARE: Final = 0.5
SHED_EVIDENCE_S: Final = 5.0  # ... and a timer fell due on the late loop this recently (a connect
# timer gave time back, a timeout was judged the loop's): a loop busy with 1,000 streams is late
# for most of every second too, yet times nothing out and serves them all (bench_overload, load
# 7, 2 cores: 20,562 of 20,562 answered 200 without shedding, 11% shed on lateness alone)


class LoopLag:
    """Summed lateness of the event loop over time (monotonic seconds, ``time.monotonic``)."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=MAX_POINTS)  # wake-up times, ascending
        self._sums: deque[float] = deque(maxlen=MAX_POINTS)  # lateness summed up to each
        self._total = 0.0
        self._due = time.monotonic() + SAMPLE_S  # when the sampler should wake next
        self._late_timer_at = -math.inf  # when a timer last fell due on the late loop

    async def run(self) -> None:
        """Sample forever (a task of the router)."""
        while True:
            self._due = time.monotonic() + SAMPLE_S
            await asyncio.sleep(SAMPLE_S)
            self.record(time.monotonic())

    def record(self, woke_at: float) -> None:
        """The sampler woke at ``woke_at`` (due at ``self._due``)."""
        late = woke_at - self._due
        if late >= MIN_LATE_S:
            self._total += late
            self._times.append(woke_at)
            self._sums.append(self._total)

    def lateness(self, since: float, now: float) -> float:
        """Seconds the loop ran late within ``[since, now]``: the recorded lateness of the
        wake-ups after ``since`` plus the wake-up overdue now (a late turn still running).
        Spans older than the points kept count from the oldest one kept."""
        i = bisect.bisect_right(self._times, since)
        if i > 0:
            before = self._sums[i - 1]
        elif len(self._times) == MAX_POINTS:
            before = self._sums[0]  # older than what is kept: count from the oldest point
        else:
            before = 0.0
        overdue = max(0.0, now - max(self._due, since))
        return min(self._total - before + overdue, now - since)

    def late(self, since: float, now: float) -> bool:
        """The rule (module docstring): the loop lost ``LATE_SHARE`` of ``[since, now]``."""
        span = now - since
        if span > 0 and self.lateness(since, now) >= LATE_SHARE * span:
            self.note_late_timer(now)
            return True
        return False

    def note_late_timer(self, now: float) -> None:
        """A timer fell due at ``now`` while the loop ran late (evidence for ``overloaded``)."""
        self._late_timer_at = now

    def overloaded(self, now: float) -> bool:
        """Whether the loop ran late for at least ``SHED_SHARE`` of the last ``SHED_WINDOW_S``
        and a timer fell due on the late loop within ``SHED_EVIDENCE_S`` (``note_late_timer``:
        the late loop is timing things out, not only busy)."""
        if now - self._late_timer_at > SHED_EVIDENCE_S:
            return False
        return self.lateness(now - SHED_WINDOW_S, now) >= SHED_SHARE * SHED_WINDOW_S


class LagTolerantTimeout:
    """``async with LagTolerantTimeout(lag, delay_s, max_s):`` an ``asyncio.timeout(delay_s)``
    that, when it falls due, first gives back the time the loop ran late since the block was
    entered (``lag.lateness``): it fires only once ``delay_s`` of the span has passed on a loop
    running on time, or ``max_s`` after entry at the latest. A late loop runs a due timer in the
    same turn as the I/O callbacks that completed the awaited operation, before the task they
    wake: without the give-back, a connect the kernel completed long before is cancelled.
    Raises ``TimeoutError`` at exit when it fired (``expired`` is then True);
    ``num_extended``: how often it moved its deadline."""

    def __init__(self, lag: LoopLag, delay_s: float, max_s: float) -> None:
        self._lag = lag
        self._delay_s = delay_s
        self._max_s = max(max_s, delay_s)
        self._timeout = asyncio.timeout(None)
        self._start = 0.0
        self._handle: asyncio.TimerHandle | None = None
        self.expired = False
        self.num_extended = 0

    async def __aenter__(self) -> LagTolerantTimeout:
        await self._timeout.__aenter__()
        self._start = time.monotonic()
        self._handle = asyncio.get_running_loop().call_later(self._delay_s, self._due)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._handle is not None:
            self._handle.cancel()
        await self._timeout.__aexit__(exc_type, exc, tb)

    def _due(self) -> None:
        now = time.monotonic()
        elapsed = now - self._start
        left = self._delay_s + self._lag.lateness(self._start, now) - elapsed
        loop = asyncio.get_running_loop()
        if left > 0 and elapsed < self._max_s:  # the loop lost time: give it back
            self.num_extended += 1
            self._lag.note_late_timer(now)
            self._handle = loop.call_later(min(left, self._max_s - elapsed), self._due)
            return
        self.expired = True
        self._timeout.reschedule(loop.time())  # cancels the block now
