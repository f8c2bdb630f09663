"""The admission gate the request path awaits: ``router.traffic.admission`` on the event loop.
asyncio only (no HTTP, no Redis).

``await gate.admit(request_id, model)`` returns an ``AdmissionSlot`` at once when nothing waits
and the fleet has room, else queues the request until room frees (``kick``: a load changed) or
its wait bound passes (``Overloaded``, 503). A waiting request whose task is cancelled (aiohttp
cancels the handler when its client disconnects) leaves the queue at once. The slot counts the
request against ``max_inflight`` until ``release``; ``dispatched`` says it now counts in its
replica's load (``LoadTracker``), so it no longer takes a free slot from the ones admitted after.

A request with a TTFT target (``admit``'s ``ttft_target_s``) is also held for it
(``router.traffic.admission.slo_verdict``): it waits while its predicted TTFT on the best replica
with room, counting the prefill of the requests admitted but not yet dispatched, would miss its
target, and while it waits no request of a lower class for the same model is admitted (they
would take the room it waits for); it is shed once even an idle replica would miss it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from router.traffic.admission import (
    SHED_QUEUE_FULL,
    SHED_QUEUE_TIMEOUT,
    SHED_TTFT_TARGET,
    SLO_MEETS,
    SLO_SHED,
    SLO_UNMEETABLE,
    SLO_WAIT,
    AdmissionLimits,
    AdmissionQueue,
    Overloaded,
    ReplicaLoad,
    SloVerdict,
    Waiting,
    slo_verdict,
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
    ``priority`` its class rank, ``tenant`` whose it is. With a TTFT target: ``slo`` is
    ``meets`` (admitted within it without being held), ``waited`` (held for it, then admitted),
    ``unmeetable``, ``shed`` (or "" for a request cancelled or shed by the limits), and
    ``predicted_ttft_s`` its predicted TTFT when admitted; without one, "" and None."""

    outcome: str
    queued: bool
    waited_s: float
    reason: str = ""
    priority: int = 0
    tenant: str = ""
    slo: str = ""
    predicted_ttft_s: float | None = None


class AdmissionSlot:
    """One admitted request's place in the fleet-wide count. ``dispatched()`` once it is counted
    in its replica's load; ``release()`` when it ends (both idempotent)."""

    __slots__ = ("_dispatched", "_gate", "_released", "pending_s", "priority", "waited_s")

    def __init__(self, gate: AdmissionGate, waited_s: float, priority: int = 0,
                 pending_s: float = 0.0) -> None:
        self._gate = gate
        self._dispatched = False
        self._released = False
        self.waited_s = waited_s
        self.priority = priority  # the request's class rank
        self.pending_s = pending_s  # its own prefill seconds, counted in the gate's until dispatched

    def dispatched(self) -> None:
        if not self._dispatched:
            self._dispatched = True
            self._gate.num_pending -= 1
            self._gate.pending_prefill_s = max(self._gate.pending_prefill_s - self.pending_s, 0.0)
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
        self.pending_prefill_s = 0.0  # the targeted ones' own prefill seconds (in no load yet)
        self._futures: dict[int, asyncio.Future[AdmissionSlot]] = {}  # {entry seq: its waiter}
        self._pump_handle: asyncio.Handle | None = None
        self._timer: asyncio.TimerHandle | None = None

    @property
    def enabled(self) -> bool:
        return self.limits.enabled

    async def admit(self, request_id: str, model: str | None, cost_s: float = 0.0,
                    priority: int = 0, tenant: str = "", work_tokens: float = 0.0,
                    ttft_target_s: float | None = None) -> AdmissionSlot:
        """Wait for room for one request for ``model`` (``cost_s``: its predicted prefill
        seconds; ``priority``: its class rank, 0 the highest; ``tenant``: whose fair share it
        takes; ``router.traffic.scheduling``; ``work_tokens``: its own prefill work and
        ``ttft_target_s`` its TTFT target, for SLO-aware admission). Raises ``Overloaded`` (503
        with Retry-After) when the queue is full, the wait bound passes or the TTFT target can
        no longer be met; ``CancelledError`` goes through, the request out of the queue."""
        now = self._clock()
        queue = self.queue
        entry = queue.new_entry(request_id, model, now, cost_s, priority, tenant, work_tokens,
                                ttft_target_s)
        if not self.enabled:
            return self._grant(now, 0.0, False, priority, tenant)
        if not len(queue) and self._fits(model):
            verdict = self._verdict(entry, now)
            if verdict is None or verdict.outcome in (SLO_MEETS, SLO_UNMEETABLE):
                return self._grant(now, 0.0, False, priority, tenant, entry, verdict)
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

    def _verdict(self, entry: Waiting, now: float) -> SloVerdict | None:
        """SLO-aware admission of ``entry`` now (None: no target, or its model is not routable
        now). The prefill admitted but not yet dispatched is spread over the replicas with room
        (where it will go is decided at dispatch)."""
        if entry.ttft_target_s is None:
            return None
        loads = self._loads_of(entry.model)
        if loads is None:
            return None
        return slo_verdict(self.limits, loads, entry.work_tokens, entry.ttft_target_s,
                           now - entry.enqueued_at, self.pending_prefill_s)

    def _grant(self, now: float, waited_s: float, queued: bool, priority: int, tenant: str,
               entry: Waiting | None = None, verdict: SloVerdict | None = None) -> AdmissionSlot:
        self.num_admitted += 1
        self.num_pending += 1
        self.queue.record_admission(now)
        slo, predicted, pending_s = "", None, 0.0
        if verdict is not None and entry is not None:
            slo = "waited" if entry.held else verdict.outcome
            predicted = verdict.predicted_ttft_s
            pending_s = verdict.idle_ttft_s
            self.pending_prefill_s += pending_s
        self._on_event(AdmissionEvent("admitted", queued, waited_s, "", priority, tenant, slo,
                                      predicted))
        return AdmissionSlot(self, waited_s, priority, pending_s)

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
        held = self._judge_targets(now)  # {model: the highest class held for its target}
        fits: dict[str | None, bool] = {}  # {model: room} within this pump: loads are unchanged
        verdicts: dict[int, SloVerdict | None] = {}  # {seq: its verdict at its admission}

        def model_has_room(model: str | None) -> bool:
            room = fits.get(model)
            if room is None:
                room = fits[model] = self._fits(model)
            return room

        def has_room(entry: Waiting) -> bool:
            if not model_has_room(entry.model) or entry.priority > held.get(entry.model,
                                                                            entry.priority):
                return False
            verdict = verdicts[entry.seq] = self._verdict(entry, now)
            return verdict is None or verdict.outcome in (SLO_MEETS, SLO_UNMEETABLE)

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
                                          admitted.priority, admitted.tenant, admitted,
                                          verdicts.get(admitted.seq)))
        self._arm_timer()

    def _judge_targets(self, now: float) -> dict[str | None, int]:
        """Shed the waiting requests whose TTFT target can no longer be met; mark those held for
        it (``Waiting.held``). Returns ``{model: the highest class (lowest rank) held}``: no
        request of a lower class for that model is admitted in this pump."""
        held: dict[str | None, int] = {}
        for entry in self.queue:
            verdict = self._verdict(entry, now)
            if verdict is None:
                continue
            waited = now - entry.enqueued_at
            if verdict.outcome == SLO_WAIT:
                entry.held = True
                held[entry.model] = min(held.get(entry.model, entry.priority), entry.priority)
            elif verdict.outcome == SLO_SHED:
                self.queue.remove(entry)
                self._on_event(AdmissionEvent("shed", True, waited, SHED_TTFT_TARGET,
                                              entry.priority, entry.tenant, SLO_SHED,
                                              verdict.predicted_ttft_s))
                future = self._futures.pop(entry.seq, None)
                if future is not None and not future.done():
                    assert entry.ttft_target_s is not None
                    retry = self.queue.retry_after_s(now)
                    future.set_exception(Overloaded(
                        f"the router is overloaded: {verdict.why(entry.ttft_target_s, waited)}; "
                        f"retry after {retry} s", retry, SHED_TTFT_TARGET))
        return held

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

    def explain(self, model: str | None, priority: int = 0, work_tokens: float = 0.0,
                ttft_target_s: float | None = None) -> dict[str, Any]:
        """What admission would do with a request for ``model`` now, for ``/debug/route``:
        ``admit`` (bool), ``wait_reason`` (why it would wait; None when admitted), each
        replica's ``inflight_requests``, ``queued_prefill_s`` and ``room``, and for SLO-aware
        admission (``admit``'s arguments) ``ttft_target_s``, ``predicted_ttft_s``, ``slo`` (an
        ``SLO_OUTCOMES`` value, None without a target) and ``slo_reason``."""
        loads = self._loads_of(model)
        slo: dict[str, Any] = {"ttft_target_s": ttft_target_s, "predicted_ttft_s": None,
                               "slo": None, "slo_reason": None}
        if not self.enabled or loads is None:
            return {"admit": True, "wait_reason": None, "replicas": {}, **slo}
        reasons = [f"{len(self.queue)} requests wait in the admission queue"] if len(
            self.queue) else []
        why = self.limits.why_no_room(loads, self.num_admitted, self.num_pending)
        if why is not None:
            reasons.append(why)
        now = self._clock()
        verdict = self._verdict(self.queue.new_entry("", model, now, 0.0, priority, "",
                                                     work_tokens, ttft_target_s), now)
        if verdict is not None and ttft_target_s is not None:
            predicted = verdict.predicted_ttft_s
            slo.update(predicted_ttft_s=round(predicted, 4) if math.isfinite(predicted) else None,
                       slo=verdict.outcome,
                       slo_reason=verdict.why(ttft_target_s, 0.0))
            if verdict.outcome not in (SLO_MEETS, SLO_UNMEETABLE):
                reasons.append(slo["slo_reason"])
        return {"admit": not reasons, "wait_reason": "; ".join(reasons) or None, **slo,
                "replicas": {
            load.replica_id: {"inflight_requests": load.inflight_requests,
                              "queued_prefill_s": round(load.queued_prefill_s, 4),
                              "room": self.limits.replica_has_room(load)} for load in loads}}

    def state(self) -> dict[str, float | int | bool]:
        """The gate's counts for ``/ready`` and ``/debug/route``."""
        now = self._clock()
        return {"enabled": self.enabled, "admitted": self.num_admitted,
                "pending": self.num_pending, "queued": len(self.queue),
                "oldest_wait_s": round(self.queue.oldest_wait_s(now), 3)}
