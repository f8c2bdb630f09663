"""The admission gate the request path awaits: ``router.traffic.admission`` on the event loop.
asyncio only (no HTTP, no Redis).

``await gate.admit(request_id, model)`` returns an ``AdmissionSlot`` at once when nothing waits
and the fleet has room, else queues the request until room frees (``kick``: a load changed) or
its wait bound passes (``Overloaded``, 503). A waiting request whose task is cancelled (aiohttp
cancels the handler when its client disconnects) leaves the queue at once. The slot counts the
request against ``max_inflight`` until ``release``; ``dispatched`` says it now counts in its
replica's load (``LoadTracker``), so it no longer takes a free slot from the ones admitted after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from router.traffic.admission import (
    SHED_QUEUE_FULL,
    SHED_QUEUE_TIMEOUT,
    AdmissionLimits,
    AdmissionQueue,
    Overloaded,
    ReplicaLoad,
    Waiting,
)
from router.traffic.scheduling import FairOrder

logger = logging.getLogger(__name__)

POLL_S: Final = 0.1  # while requests wait, room is re-checked at least this often: capacity can
# free without a load change this router sees (a replica joins, a learned rate improves)

# {model: the loads of the replicas that could serve it}, None: the model cannot be routed now
# (unknown, no routable replica): admitted at once, and routing answers its 404/503
LoadsOf = Callable[[str | None], Sequence[ReplicaLoad] | None]


@dataclass(frozen=True, slots=True)
class AdmissionEvent:
    """What happened to one request at the gate, for metrics and logs: ``outcome`` is
    ``admitted`` (at once or from the queue: ``queued``), ``shed`` (``reason``) or
    ``cancelled`` (its client left while it waited); ``waited_s`` seconds in the queue;
    ``priority`` its class rank, ``tenant`` whose it is."""

    outcome: str
    queued: bool
    waited_s: float
    reason: str = ""
    priority: int = 0
    tenant: str = ""


class AdmissionSlot:
    """One admitted request's place in the fleet-wide count. ``dispatched()`` once it is counted
    in its replica's load; ``release()`` when it ends (both idempotent)."""

    __slots__ = ("_dispatched", "_gate", "_released", "priority", "waited_s")

    def __init__(self, gate: AdmissionGate, waited_s: float, priority: int = 0) -> None:
        self._gate = gate
        self._dispatched = False
        self._released = False
        self.waited_s = waited_s
        self.priority = priority  # the request's class rank

    def dispatched(self) -> None:
        if not self._dispatched:
            self._dispatched = True
            self._gate.num_pending -= 1
            self._gate.kick()

    def release(self) -> None:
        if self._released:
            return
        self.dispatched()
        self._released = True
        self._gate.num_admitted -= 1
        self._gate.kick()


class AdmissionGate:
    """The bounded queue in front of the fleet (see the module docstring).

    ``loads_of(model)`` gives the loads of the replicas that could serve ``model`` now;
    ``on_event(event)`` is told every request's outcome; ``clock`` is monotonic seconds;
    ``order`` the admission order (default: arrival order within one class and tenant).
    """

    def __init__(self, limits: AdmissionLimits, loads_of: LoadsOf,
                 on_event: Callable[[AdmissionEvent], None] = lambda event: None,
                 clock: Callable[[], float] = time.monotonic,
                 order: FairOrder | None = None) -> None:
        self.limits = limits
        self.queue = AdmissionQueue(limits, order)
        self._loads_of = loads_of
        self._on_event = on_event
        self._clock = clock
        self.num_admitted = 0  # admitted and not released (fleet-wide in-flight of this router)
        self.num_pending = 0  # admitted and not yet dispatched
        self._futures: dict[int, asyncio.Future[AdmissionSlot]] = {}  # {entry seq: its waiter}
        self._pump_handle: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def enabled(self) -> bool:
        return self.limits.enabled

    async def admit(self, request_id: str, model: str | None, cost_s: float = 0.0,
                    priority: int = 0, tenant: str = "") -> AdmissionSlot:
        """Wait for room for one request for ``model`` (``cost_s``: its predicted prefill
        seconds; ``priority``: its class rank, 0 the highest; ``tenant``: whose fair share it
        takes; ``router.traffic.scheduling``). Raises ``Overloaded`` (503 with Retry-After) when the queue is full or the
        wait bound passes; ``CancelledError`` goes through, the request out of the queue."""
        now = self._clock()
        queue = self.queue
        if not self.enabled or (not len(queue) and self._fits(model)):
            return self._grant(now, 0.0, False, priority, tenant)
        entry = queue.new_entry(request_id, model, now, cost_s, priority, tenant)
        if not queue.offer(entry):
            retry = queue.retry_after_s(now)
            self._on_event(AdmissionEvent("shed", False, 0.0, SHED_QUEUE_FULL, priority, tenant))
            raise Overloaded(f"the router is overloaded: {len(queue)} requests wait for room "
                             f"(admission_max_queue_length); retry after {retry} s",
                             retry, SHED_QUEUE_FULL)
        future: asyncio.Future[AdmissionSlot] = asyncio.get_running_loop().create_future()
        self._futures[entry.seq] = future
        self._arm_timer()
        try:
            return await future
        except asyncio.CancelledError:
            self._futures.pop(entry.seq, None)
            if queue.remove(entry):
                self._on_event(AdmissionEvent("cancelled", True, self._clock() - now, "",
                                              priority, tenant))
                self.kick()  # its place may let a later request through (not room itself)
            elif future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()  # admitted as the client left: give the slot back
            raise

    def kick(self) -> None:
        """Room may have freed (a request finished or reached its replica): admit what fits,
        soon (once per loop turn however many kicks)."""
        if self._pump_handle is None and len(self.queue):
            self._pump_handle = asyncio.get_running_loop().call_soon(self._pump)

    def _fits(self, model: str | None) -> bool:
        loads = self._loads_of(model)
        return loads is None or self.limits.has_room(loads, self.num_admitted, self.num_pending)

    def _grant(self, now: float, waited_s: float, queued: bool, priority: int,
               tenant: str) -> AdmissionSlot:
        self.num_admitted += 1
        self.num_pending += 1
        self.queue.record_admission(now)
        self._on_event(AdmissionEvent("admitted", queued, waited_s, "", priority, tenant))
        return AdmissionSlot(self, waited_s, priority)

    def _pump(self) -> None:
        """Shed the requests past their bound, then admit, in order, every one that fits."""
        self._pump_handle = None
        now = self._clock()
        queue = self.queue
        for entry in queue.expire(now):
            future = self._futures.pop(entry.seq, None)
            waited = now - entry.enqueued_at
            self._on_event(AdmissionEvent("shed", True, waited, SHED_QUEUE_TIMEOUT,
                                          entry.priority, entry.tenant))
            if future is not None and not future.done():
                retry = queue.retry_after_s(now)
                future.set_exception(Overloaded(
                    f"the router is overloaded: no room for the request within {waited:.1f} s "
                    f"(admission_max_queue_wait_s); retry after {retry} s",
                    retry, SHED_QUEUE_TIMEOUT))
        fits: dict[str | None, bool] = {}  # {model: room} within this pump: loads are unchanged

        def model_has_room(model: str | None) -> bool:
            room = fits.get(model)
            if room is None:
                room = fits[model] = self._fits(model)
            return room

        def has_room(entry: Waiting) -> bool:
            return model_has_room(entry.model)

        # (the models first: a pop that finds no room scans every waiting request)
        while len(queue) and any(model_has_room(m) for m in queue.models()):
            admitted = queue.pop_next(has_room, now)
            if admitted is None:
                break
            fits.clear()  # the admission took a slot
            future = self._futures.pop(admitted.seq, None)
            if future is None or future.done():
                continue
            future.set_result(self._grant(now, now - admitted.enqueued_at, True,
                                          admitted.priority, admitted.tenant))
        self._arm_timer()

    def _arm_timer(self) -> None:
        """Pump again at the next deadline, or in ``POLL_S``, whichever comes first."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = self.queue.next_deadline()
        if deadline is None:
            return
        delay = min(max(deadline - self._clock(), 0.0), POLL_S)
        self._timer = asyncio.get_running_loop().call_later(delay, self._pump)

    def explain(self, model: str | None) -> dict[str, Any]:
        """What admission would do with a request for ``model`` now, for ``/debug/route``:
        ``admit`` (bool), ``wait_reason`` (why it would wait; None when admitted), and each
        replica's ``inflight_requests``, ``queued_prefill_s`` and ``room``."""
        loads = self._loads_of(model)
        if not self.enabled or loads is None:
            return {"admit": True, "wait_reason": None, "replicas": {}}
        reasons = [f"{len(self.queue)} requests wait in the admission queue"] if len(
            self.queue) else []
        why = self.limits.why_no_room(loads, self.num_admitted, self.num_pending)
        if why is not None:
            reasons.append(why)
        return {"admit": not reasons, "wait_reason": "; ".join(reasons) or None, "replicas": {
            load.replica_id: {"inflight_requests": load.inflight_requests,
                              "queued_prefill_s": round(load.queued_prefill_s, 4),
                              "room": self.limits.replica_has_room(load)} for load in loads}}

    def state(self) -> dict[str, float | int | bool]:
        """The gate's counts for ``/ready`` and ``/debug/route``."""
        now = self._clock()
        return {"enabled": self.enabled, "admitted": self.num_admitted,
                "pending": self.num_pending, "queued": len(self.queue),
                "oldest_wait_s": round(self.queue.oldest_wait_s(now), 3)}
