"""Admission: limits on what the router lets into the fleet, and the bounded queue in front of
it. Pure: no I/O, no asyncio; the clock is passed in (``now``, monotonic seconds).

A request is **admitted** when the fleet has room for it: fewer than ``max_inflight`` of this
router's requests are admitted and not finished, and at least one replica that can serve it has
room (fewer than ``max_inflight_per_replica`` of this router's requests in flight there, and less
than ``max_queued_prefill_s`` of predicted prefill queued there: the prefill tokens of this
router's requests there not yet at their first token, at the replica's learned rate,
``router.ttft``). Otherwise it **waits** in the ``AdmissionQueue``, bounded in length
(``max_queue_length``) and in time (``max_queue_wait_s``); a request the queue cannot take, or
that waited its whole bound, is **shed** with a 503 carrying ``Retry-After``
(``Overloaded``). The routing decision is made when a request leaves the queue, among the
replicas that have room then (``AdmissionLimits.replica_has_room``).

The shape follows the routers that have one: Dynamo's router queue (a threshold, then refusal),
llm-d's flow control (a bounded queue per flow, TTL-bounded waits) and SMG's
``--max-concurrent-requests`` with its queue size and queue timeout.

Every limit is off at 0; with all of them off (the default) nothing waits and nothing is shed.

**SLO-aware admission** (``slo_verdict``): a request whose class has a TTFT target is also held
for it. Its predicted TTFT is the ``ttft`` policy's model (``router.decision.ttft``) on the best
replica with room: the replica's overhead, plus its queued prefill, plus the request's own
prefill work at the replica's learned rate (no prefix hit counted: the request is not tokenized
before it leaves the queue, so the prediction errs long). It waits while the seconds it has
waited plus that prediction exceed its target, and is shed (503, ``SHED_TTFT_TARGET``) once even
an idle replica could no longer meet it: waited + the idle prediction > target. A request whose
idle prediction alone exceeds its target (its own prefill is longer than the target) cannot be
helped by waiting: it is judged by the limits alone (``SLO_UNMEETABLE``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from router.request.errors import RouterError
from router.traffic.scheduling import FairOrder

DEFAULT_MAX_QUEUE_LENGTH: Final = 1024  # requests waiting at most (SMG's default queue size is 100
# per 100 concurrent; a router in front of a fleet of 8-16 replicas holds more)
DEFAULT_MAX_QUEUE_WAIT_S: Final = 30.0  # seconds a request waits at most before a 503 (SMG's
# queue timeout default is 60 s; half of it leaves a client with a 60 s timeout time to retry)
RATE_WINDOW_S: Final = 10.0  # seconds of admissions the drain rate (Retry-After) is measured over
RETRY_AFTER_MAX_S: Final = 60  # Retry-After never says more than this (seconds)

RETRY_AFTER_HEADER: Final = "Retry-After"
SHED_QUEUE_FULL: Final = "queue_full"
SHED_QUEUE_TIMEOUT: Final = "queue_timeout"
SHED_TTFT_TARGET: Final = "ttft_target"  # its TTFT target can no longer be met (SLO admission)
SHED_REASONS: Final = (SHED_QUEUE_FULL, SHED_QUEUE_TIMEOUT, SHED_TTFT_TARGET)
# what SLO-aware admission makes of one request (``slo_verdict``)
SLO_MEETS: Final = "meets"  # predicted within its target: admitted when the limits allow
SLO_WAIT: Final = "wait"  # predicted past its target, waiting can still meet it
SLO_SHED: Final = "shed"  # even an idle replica would now miss it
SLO_UNMEETABLE: Final = "unmeetable"  # its own prefill alone misses it: the limits decide
SLO_OUTCOMES: Final = (SLO_MEETS, SLO_WAIT, SLO_SHED, SLO_UNMEETABLE)


class Overloaded(RouterError):
    """503: the fleet is at its admission limits and the request cannot wait for room (the
    queue is full, or it waited ``max_queue_wait_s``). ``retry_after_s`` (whole seconds) goes
    out as ``Retry-After``; ``reason`` is one of ``SHED_REASONS``."""

    status, error_type = 503, "ServiceUnavailableError"

    def __init__(self, message: str, retry_after_s: int, reason: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason
        self.headers[RETRY_AFTER_HEADER] = str(retry_after_s)


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """The admission settings (``RouterConfig``'s ``admission_*``). A limit of 0 is off.

    Raises ``ValueError`` for a negative limit, a queue length < 1 or a wait bound <= 0.
    """

    max_inflight: int = 0  # this router's requests admitted and not finished, fleet-wide
    max_inflight_per_replica: int = 0  # this router's requests in flight on one replica
    max_queued_prefill_s: float = 0.0  # predicted seconds of prefill queued on one replica
    max_queue_length: int = DEFAULT_MAX_QUEUE_LENGTH  # requests waiting for room, at most
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S  # seconds one request waits, at most

    def __post_init__(self) -> None:
        if min(self.max_inflight, self.max_inflight_per_replica) < 0 or not (
                self.max_queued_prefill_s >= 0):
            raise ValueError("admission limits must be >= 0 (0: no limit)")
        if self.max_queue_length < 1:
            raise ValueError("max_queue_length must be >= 1")
        if not self.max_queue_wait_s > 0:
            raise ValueError("max_queue_wait_s must be > 0")

    @property
    def enabled(self) -> bool:
        """Whether any limit is set (else admission lets everything through at once)."""
        return bool(self.max_inflight or self.max_inflight_per_replica
                    or self.max_queued_prefill_s)

    def replica_has_room(self, load: ReplicaLoad) -> bool:
        """Whether one more request may be sent to the replica with ``load``."""
        if self.max_inflight_per_replica and (
                load.inflight_requests >= self.max_inflight_per_replica):
            return False
        return not (self.max_queued_prefill_s
                    and load.queued_prefill_s >= self.max_queued_prefill_s)

    def replica_free_slots(self, load: ReplicaLoad) -> int:
        """Requests that may still be admitted towards the replica before the ones admitted
        earlier are counted there: the free in-flight slots, or 1 when only the prefill limit
        applies (a request's prefill is counted once it is dispatched, so one at a time)."""
        if not self.replica_has_room(load):
            return 0
        if self.max_inflight_per_replica:
            return self.max_inflight_per_replica - load.inflight_requests
        return 1

    def why_no_room(self, loads: Sequence[ReplicaLoad], num_admitted: int,
                    num_pending: int) -> str | None:
        """Why one more request would wait (``has_room``'s arguments), for people (``/debug/route``
        and logs); None when it has room."""
        if self.has_room(loads, num_admitted, num_pending):
            return None
        if self.max_inflight and num_admitted >= self.max_inflight:
            return (f"{num_admitted} requests in flight (admission_max_inflight "
                    f"{self.max_inflight})")
        if not loads:
            return "no replica serves the model"
        full = [load for load in loads if not self.replica_has_room(load)]
        if len(full) < len(loads):
            return (f"the replicas with room have {num_pending} admitted requests on their way "
                    "(counted there once dispatched)")
        parts = []
        if self.max_inflight_per_replica:
            parts.append(f"admission_max_inflight_per_replica {self.max_inflight_per_replica}")
        if self.max_queued_prefill_s:
            parts.append(f"admission_max_queued_prefill_s {self.max_queued_prefill_s:g}")
        return f"every replica that serves the model is at its limit ({', '.join(parts)})"

    def has_room(self, loads: Sequence[ReplicaLoad], num_admitted: int, num_pending: int) -> bool:
        """Whether the fleet can take one more request: ``loads`` are the replicas that could
        serve it, ``num_admitted`` this router's requests admitted and not finished,
        ``num_pending`` those of them admitted but not yet dispatched (counted in no replica's
        load yet: they take free slots first)."""
        if self.max_inflight and num_admitted >= self.max_inflight:
            return False
        if not (self.max_inflight_per_replica or self.max_queued_prefill_s):
            return True
        free = 0
        for load in loads:
            free += self.replica_free_slots(load)
            if free > num_pending:
                return True
        return False


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One replica's load as admission sees it."""

    replica_id: str
    inflight_requests: int = 0  # this router's requests sent there and not finished
    queued_prefill_s: float = 0.0  # predicted seconds of this router's prefill queued there
    s_per_token: float = 0.0  # its learned seconds per prefill work token (router.decision.ttft)
    overhead_s: float = 0.0  # its learned TTFT overhead (seconds)

    def idle_ttft_s(self, work_tokens: float) -> float:
        """Predicted TTFT (seconds) of ``work_tokens`` of prefill work with nothing queued."""
        return self.overhead_s + work_tokens * self.s_per_token

    def predicted_ttft_s(self, work_tokens: float) -> float:
        """Predicted TTFT (seconds) of ``work_tokens`` of prefill work sent here now: the ttft
        policy's ``wait_s + prefill_s`` (``router.decision.policy``) without a prefix hit."""
        return self.queued_prefill_s + self.idle_ttft_s(work_tokens)


@dataclass(frozen=True, slots=True)
class SloVerdict:
    """``slo_verdict``'s answer: ``outcome`` (one of ``SLO_OUTCOMES``), the best replica's
    predicted TTFT and the idle one's (seconds; inf when no replica has room / serves)."""

    outcome: str
    predicted_ttft_s: float
    idle_ttft_s: float

    def why(self, target_s: float, waited_s: float) -> str:
        """The verdict for people (``/debug/route``, the 503's message)."""
        seen = (f"waited {waited_s:.2f} s + predicted TTFT {self.predicted_ttft_s:.2f} s on the "
                f"best replica with room, target {target_s:g} s")
        return {SLO_MEETS: f"meets its TTFT target ({seen})",
                SLO_WAIT: f"waits for its TTFT target ({seen})",
                SLO_SHED: (f"shed: its TTFT target {target_s:g} s can no longer be met (waited "
                           f"{waited_s:.2f} s + {self.idle_ttft_s:.2f} s on an idle replica)"),
                SLO_UNMEETABLE: (f"its own prefill ({self.idle_ttft_s:.2f} s on an idle replica) "
                                 f"exceeds its TTFT target {target_s:g} s: not held for it"),
                }[self.outcome]


def slo_verdict(limits: AdmissionLimits, loads: Sequence[ReplicaLoad], work_tokens: float,
                target_s: float, waited_s: float, pending_s: float = 0.0) -> SloVerdict:
    """SLO-aware admission of one request (module docstring): ``loads`` the replicas that could
    serve it, ``work_tokens`` its own prefill work, ``target_s`` its class's TTFT target,
    ``waited_s`` the seconds it waited so far, ``pending_s`` prefill seconds admitted but in no
    replica's load yet, spread over the replicas with room. ``SLO_MEETS`` says nothing of the
    limits (the caller checks them); with no replica with room, the prediction is inf (it
    waits)."""
    idle = min((load.idle_ttft_s(work_tokens) for load in loads), default=math.inf)
    room = [load.predicted_ttft_s(work_tokens) for load in loads if limits.replica_has_room(load)]
    best = min(room) + pending_s / len(room) if room else math.inf
    if idle > target_s:
        outcome = SLO_UNMEETABLE
    elif waited_s + idle > target_s:
        outcome = SLO_SHED
    elif waited_s + best > target_s:
        outcome = SLO_WAIT
    else:
        outcome = SLO_MEETS
    return SloVerdict(outcome, best, idle)


@dataclass(eq=False, slots=True)
class Waiting:
    """One request waiting for room. ``model`` decides which replicas could serve it;
    ``cost_s`` is its predicted prefill seconds (what fairness counts); ``deadline`` the
    monotonic time its wait ends in a 503."""

    request_id: str
    model: str | None
    enqueued_at: float
    deadline: float
    cost_s: float = 0.0
    priority: int = 0  # class rank, 0 the highest (``router.traffic.scheduling``)
    tenant: str = ""  # whose share of the fleet it takes ("" without API keys)
    work_tokens: float = 0.0  # its own prefill work (router.decision.ttft), for its TTFT
    ttft_target_s: float | None = None  # its class's TTFT target; None: none (SLO admission)
    seq: int = 0  # arrival order, set by the queue
    held: bool = False  # it waited for its TTFT target at some point (SLO admission)
    queued: bool = field(default=False)  # in the queue now (False once popped, removed, expired)


class AdmissionQueue:
    """The waiting requests, bounded in length and in wait, admitted in ``order``'s order
    (``router.traffic.scheduling.FairOrder``: priority classes, aging, fairness between
    tenants; with one class and one tenant, arrival order).

    ``offer`` adds one (False when full); ``pop_next(fits, now)`` takes the next that ``fits``
    (requests for a model whose replicas are full do not hold up others); ``remove`` takes one
    out (its client left); ``expire(now)`` takes out those past their deadline.
    ``record_admission``/``retry_after_s`` measure the drain rate for ``Retry-After``.
    """

    __slots__ = ("_admitted_at", "_deadlines", "_models", "_seq", "_waiting", "limits", "order")

    def __init__(self, limits: AdmissionLimits, order: FairOrder | None = None) -> None:
        self.limits = limits
        # not ``order or ...``: an empty FairOrder has len 0, so the configured one (its aging
        # and weights) was replaced by the default and never used
        self.order = order if order is not None else FairOrder()
        self._waiting: dict[int, Waiting] = {}  # {seq: entry}, arrival order
        self._models: Counter[str | None] = Counter()  # {model: entries waiting for it}
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, seq); stale ones skipped
        self._seq = itertools.count()
        self._admitted_at: deque[float] = deque()  # admission times in the last RATE_WINDOW_S

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Waiting]:
        return iter(list(self._waiting.values()))

    def new_entry(self, request_id: str, model: str | None, now: float, cost_s: float = 0.0,
                  priority: int = 0, tenant: str = "", work_tokens: float = 0.0,
                  ttft_target_s: float | None = None) -> Waiting:
        """An entry arriving ``now``, waiting at most ``max_queue_wait_s`` (not yet offered)."""
        return Waiting(request_id, model, now, now + self.limits.max_queue_wait_s, cost_s,
                       priority, tenant, work_tokens, ttft_target_s)

    def offer(self, entry: Waiting) -> bool:
        """Queue ``entry``; False (and nothing queued) when ``max_queue_length`` wait already."""
        if len(self._waiting) >= self.limits.max_queue_length:
            return False
        entry.seq = next(self._seq)
        entry.queued = True
        self._waiting[entry.seq] = entry
        self._models[entry.model] += 1
        self.order.add(entry)
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq))
        return True

    def pop_next(self, fits: Callable[[Waiting], bool], now: float) -> Waiting | None:
        """Take out the next entry to admit for which ``fits(entry)``; None if none."""
        entry = self.order.pop(fits, now)  # type: ignore[arg-type]
        if entry is None:
            return None
        assert isinstance(entry, Waiting)
        del self._waiting[entry.seq]
        self._uncount(entry)
        entry.queued = False
        self._drop_stale()
        return entry

    def remove(self, entry: Waiting) -> bool:
        """Take ``entry`` out (its client left); False if it was no longer queued."""
        if not entry.queued:
            return False
        self._take(entry)
        return True

    def expire(self, now: float) -> list[Waiting]:
        """Take out and return the entries whose deadline is ``<= now``, earliest first."""
        out: list[Waiting] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, seq = heapq.heappop(heap)
            entry = self._waiting.get(seq)
            if entry is not None:
                self._take(entry)
                out.append(entry)
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline of a queued entry (None when the queue is empty)."""
        heap = self._deadlines
        while heap and heap[0][1] not in self._waiting:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def oldest_wait_s(self, now: float) -> float:
        """Seconds the longest-waiting entry has waited (0 when empty)."""
        first = next(iter(self._waiting.values()), None)
        return 0.0 if first is None else max(now - first.enqueued_at, 0.0)

    def models(self) -> list[str | None]:
        """The models the waiting entries are for (each once)."""
        return list(self._models)

    def _uncount(self, entry: Waiting) -> None:
        self._models[entry.model] -= 1
        if not self._models[entry.model]:
            del self._models[entry.model]

    def _take(self, entry: Waiting) -> None:
        del self._waiting[entry.seq]
        self._uncount(entry)
        self.order.remove(entry)
        entry.queued = False
        self._drop_stale()

    def _drop_stale(self) -> None:
        if not self._waiting:
            self._deadlines.clear()  # all stale

    def record_admission(self, now: float) -> None:
        """A request was admitted ``now`` (from the queue or at once): the drain rate's sample."""
        self._admitted_at.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        times = self._admitted_at
        while times and times[0] <= now - RATE_WINDOW_S:
            times.popleft()

    def retry_after_s(self, now: float, ahead: int | None = None) -> int:
        """Whole seconds after which a retry may find room: the time the queue takes to admit
        ``ahead`` requests (default: all that wait, plus one) at the rate it admitted over the
        last ``RATE_WINDOW_S``, or ``max_queue_wait_s`` when it admitted none; between 1 and
        ``RETRY_AFTER_MAX_S``."""
        self._trim(now)
        ahead = len(self._waiting) + 1 if ahead is None else ahead
        rate = len(self._admitted_at) / RATE_WINDOW_S  # admissions per second
        seconds = ahead / rate if rate > 0 else self.limits.max_queue_wait_s
        return int(min(max(math.ceil(seconds), 1), RETRY_AFTER_MAX_S))
