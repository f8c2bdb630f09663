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
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from typing import Final

SAMPLE_S: Final = 0.05  # one wake-up every 50 ms: 20 cheap callbacks a second
LATE_SHARE: Final = 0.25  # a span whose loop lateness is this share of it was the router's fault
MIN_LATE_S: Final = 0.002  # a wake-up later than this is recorded (below it: scheduling noise)
MAX_POINTS: Final = 32_768  # late wake-ups kept (27 min of a loop late on every wake-up)


class LoopLag:
    """Summed lateness of the event loop over time (monotonic seconds, ``time.monotonic``)."""

    def __init__(self) -> None:
        self._times: deque[float] = deque(maxlen=MAX_POINTS)  # wake-up times, ascending
        self._sums: deque[float] = deque(maxlen=MAX_POINTS)  # lateness summed up to each
        self._total = 0.0
        self._due = time.monotonic() + SAMPLE_S  # when the sampler should wake next

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
        return span > 0 and self.lateness(since, now) >= LATE_SHARE * span
