"""The order in which waiting requests are admitted: priority classes with aging, and deficit
round robin between the tenants of one class. Pure: no I/O; the clock is passed in.

**Classes** are ranks, 0 the highest. A lower class waits while a higher one has a request that
fits, so the order is strict, with **aging**: a class's rank improves by one for every
``aging_s`` its longest-waiting request has waited (never past 0), and between classes of the
same effective rank the one whose longest wait is longer goes first. So the lowest of ``n``
classes waits at most about ``(n - 1) * aging_s`` behind a higher class that never empties
(``aging_s`` 0: no aging, strict order).

**Fairness** inside a class is deficit round robin (Shreedhar and Varghese, 1995; Dynamo's
weighted classes and llm-d's fairness between flows do the same) over each request's predicted
prefill seconds (``cost_s``): the tenants with requests that fit take turns; a tenant whose
deficit covers its first request's cost is served (and keeps its turn), else its deficit grows
by ``quantum_s * weight`` and the turn passes. A tenant whose queue empties loses its deficit
(no banked credit). So under contention each tenant gets prefill seconds in proportion to its
weight, whatever the sizes or number of its requests. A tenant whose requests do not fit (their
model's replicas are full) is passed over without credit.

Each tenant's requests leave in arrival order among those that fit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final, Protocol

DEFAULT_QUANTUM_S: Final = 0.0001  # prefill seconds a weight-1 tenant is credited per turn. A tenant
# whose queue empties loses the credit it had left (under a quantum), so a tenant with one request
# waiting at a time falls behind a backlogged one by up to a quantum per request: against 3x its
# offered load, a quantum of 0.05 s gave it 44.5% of the prefill of 0.2 s requests (42.3% at 0.22
# s, 11.6% at 0.013 s); 0.001 s: 49.9%, 49.9%, 48.2%; 0.0001 s: 50.0%, 50.0%, 49.8% (47.6% at 1
# ms requests). Small quanta cost nothing: a round that serves nobody credits the rounds still
# needed at once (2,000 admissions in 0.2 s of test time, unchanged)
CREDIT_TOLERANCE_S: Final = 1e-9  # a deficit this close to the cost covers it (float sums)


class Entry(Protocol):
    """What the order needs of a waiting request."""

    seq: int  # arrival order, unique
    enqueued_at: float  # monotonic seconds
    cost_s: float  # predicted prefill seconds (>= 0)
    priority: int  # class rank, 0 the highest
    tenant: str


@dataclass(slots=True)
class _TenantQueue:
    entries: dict[int, Entry] = field(default_factory=dict)  # {seq: entry}, arrival order
    deficit_s: float = 0.0


class _ClassQueue:
    """One class's requests: a queue per tenant and the tenants' turn order."""

    __slots__ = ("tenants", "turns")

    def __init__(self) -> None:
        self.tenants: dict[str, _TenantQueue] = {}  # {tenant: its queue}
        self.turns: deque[str] = deque()  # tenants with requests, the one whose turn it is first

    def __len__(self) -> int:
        return sum(len(t.entries) for t in self.tenants.values())

    def add(self, entry: Entry) -> None:
        queue = self.tenants.get(entry.tenant)
        if queue is None:
            queue = self.tenants[entry.tenant] = _TenantQueue()
            self.turns.append(entry.tenant)
        queue.entries[entry.seq] = entry

    def remove(self, entry: Entry) -> None:
        queue = self.tenants[entry.tenant]
        del queue.entries[entry.seq]
        if not queue.entries:
            del self.tenants[entry.tenant]
            self.turns.remove(entry.tenant)

    def oldest(self) -> float:
        """The earliest ``enqueued_at`` in the class (inf when empty)."""
        return min((next(iter(t.entries.values())).enqueued_at for t in self.tenants.values()),
                   default=math.inf)

    def pop(self, fits: Callable[[Entry], bool], weight_of: Callable[[str], float],
            quantum_s: float) -> Entry | None:
        """Deficit round robin over the tenants with a request that fits (module docstring)."""
        heads: dict[str, Entry] = {}  # {tenant: its first request that fits}
        for tenant, queue in self.tenants.items():
            head = next((e for e in queue.entries.values() if fits(e)), None)
            if head is not None:
                heads[tenant] = head
        if not heads:
            return None
        turns = self.turns
        while True:
            for _ in range(len(turns)):
                tenant = turns[0]
                head = heads.get(tenant)
                if head is not None:
                    queue = self.tenants[tenant]
                    if queue.deficit_s >= head.cost_s - CREDIT_TOLERANCE_S:
                        queue.deficit_s -= head.cost_s
                        self.remove(head)  # (an emptied tenant leaves the turns, deficit and all)
                        return head
                    queue.deficit_s += quantum_s * weight_of(tenant)
                turns.rotate(-1)
            # a whole round served nobody: give every tenant at once the rounds the first of
            # them still needs, less one (a 100 s prompt needs no 2,000 turns of 0.05 s)
            rounds = min(math.ceil((h.cost_s - self.tenants[t].deficit_s)
                                   / (quantum_s * weight_of(t))) for t, h in heads.items())
            for tenant in heads:
                self.tenants[tenant].deficit_s += max(rounds - 1, 0) * quantum_s * weight_of(tenant)


class FairOrder:
    """The waiting requests in admission order (see the module docstring).

    ``weight_of(tenant)`` gives a tenant's weight (> 0; default 1 for all); ``aging_s`` 0 turns
    aging off. Raises ``ValueError`` for ``aging_s < 0`` or ``quantum_s <= 0``.
    """

    __slots__ = ("_classes", "_count", "aging_s", "quantum_s", "weight_of")

    def __init__(self, aging_s: float = 0.0, quantum_s: float = DEFAULT_QUANTUM_S,
                 weight_of: Callable[[str], float] = lambda tenant: 1.0) -> None:
        if not aging_s >= 0:
            raise ValueError("aging_s must be >= 0")
        if not quantum_s > 0:
            raise ValueError("quantum_s must be > 0")
        self.aging_s = aging_s
        self.quantum_s = quantum_s
        self.weight_of = weight_of
        self._classes: dict[int, _ClassQueue] = {}  # {rank: its queue}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Entry]:
        """Every waiting request, by class and tenant (not the admission order)."""
        for rank in sorted(self._classes):
            for queue in self._classes[rank].tenants.values():
                yield from queue.entries.values()

    def add(self, entry: Entry) -> None:
        """Add a request (its ``seq`` unique among those waiting). Raises ``ValueError`` for a
        negative rank or cost."""
        if entry.priority < 0 or not entry.cost_s >= 0:
            raise ValueError("priority rank and cost_s must be >= 0")
        self._classes.setdefault(entry.priority, _ClassQueue()).add(entry)
        self._count += 1

    def remove(self, entry: Entry) -> None:
        """Take a waiting request out. Raises ``KeyError`` if it does not wait."""
        cls = self._classes[entry.priority]
        cls.remove(entry)
        self._count -= 1
        if not cls.tenants:
            del self._classes[entry.priority]

    def effective_rank(self, rank: int, oldest: float, now: float) -> int:
        """A class's rank after aging: ``rank`` less one per ``aging_s`` its longest-waiting
        request (arrived at ``oldest``) waited, at least 0."""
        if not self.aging_s:
            return rank
        return max(rank - int(max(now - oldest, 0.0) // self.aging_s), 0)

    def pop(self, fits: Callable[[Entry], bool], now: float) -> Entry | None:
        """Take out the next request to admit among those that ``fits``; None if none fits."""
        ranked = []
        for rank, cls in self._classes.items():
            oldest = cls.oldest()
            ranked.append((self.effective_rank(rank, oldest, now), oldest, rank))
        for _, _, rank in sorted(ranked):
            entry = self._classes[rank].pop(fits, self.weight_of, self.quantum_s)
            if entry is not None:
                self._count -= 1
                if not self._classes[rank].tenants:
                    del self._classes[rank]
                return entry
        return None
