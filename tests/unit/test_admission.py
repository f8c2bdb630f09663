"""Admission (issue 33, step 1): the limits, the bounded queue and the asyncio gate over them.
Pure tables for ``router.traffic.admission``; the gate runs on a real event loop with loads the
test sets."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from router.traffic.admission import (
    RETRY_AFTER_HEADER,
    RETRY_AFTER_MAX_S,
    SHED_QUEUE_FULL,
    SHED_QUEUE_TIMEOUT,
    AdmissionLimits,
    AdmissionQueue,
    Overloaded,
    ReplicaLoad,
)
from router.traffic.gate import AdmissionEvent, AdmissionGate
from router.traffic.scheduling import FairOrder

# -- limits -------------------------------------------------------------------------------------


def test_limits_default_off_and_validated() -> None:
    assert not AdmissionLimits().enabled
    assert AdmissionLimits(max_inflight=1).enabled
    assert AdmissionLimits(max_queued_prefill_s=0.5).enabled
    for bad in ({"max_inflight": -1}, {"max_inflight_per_replica": -1},
                {"max_queued_prefill_s": -0.1}, {"max_queued_prefill_s": float("nan")},
                {"max_queue_length": 0}, {"max_queue_wait_s": 0.0}):
        with pytest.raises(ValueError):
            AdmissionLimits(**bad)


def test_no_limit_always_has_room() -> None:
    assert AdmissionLimits().has_room([ReplicaLoad("a", 10**6, 1e9)], 10**6, 10**6)


def test_fleet_limit_counts_admitted_requests() -> None:
    limits = AdmissionLimits(max_inflight=3)
    loads = [ReplicaLoad("a", 100)]
    assert limits.has_room(loads, 2, 0)
    assert not limits.has_room(loads, 3, 0)


@pytest.mark.parametrize(("inflight", "pending", "room"), [
    ((0, 0), 0, True), ((2, 2), 0, False), ((1, 2), 0, True), ((1, 2), 1, False),
    ((0, 1), 2, True), ((0, 1), 3, False),
])
def test_per_replica_limit_with_pending_admissions(inflight: tuple[int, int], pending: int,
                                                    room: bool) -> None:
    # 2 per replica: the free slots of both replicas, less those admitted and not yet dispatched
    limits = AdmissionLimits(max_inflight_per_replica=2)
    loads = [ReplicaLoad("a", inflight[0]), ReplicaLoad("b", inflight[1])]
    assert limits.has_room(loads, sum(inflight) + pending, pending) is room


def test_queued_prefill_limit_one_pending_per_replica() -> None:
    limits = AdmissionLimits(max_queued_prefill_s=1.0)
    assert not limits.replica_has_room(ReplicaLoad("a", 0, 1.0))
    assert limits.replica_has_room(ReplicaLoad("a", 50, 0.99))
    loads = [ReplicaLoad("a", 0, 0.2), ReplicaLoad("b", 0, 3.0)]
    assert limits.has_room(loads, 0, 0)
    # the one replica with room already has an admitted request on its way: its prefill is
    # not counted there yet, so no second one goes before it is
    assert not limits.has_room(loads, 1, 1)
    assert not limits.has_room([], 0, 0)  # no replica that could serve it


def test_both_replica_limits_apply() -> None:
    limits = AdmissionLimits(max_inflight_per_replica=4, max_queued_prefill_s=1.0)
    assert limits.replica_free_slots(ReplicaLoad("a", 1, 0.5)) == 3
    assert limits.replica_free_slots(ReplicaLoad("a", 1, 1.5)) == 0
    assert limits.replica_free_slots(ReplicaLoad("a", 4, 0.0)) == 0


def test_why_no_room_names_the_limit() -> None:
    fleet_limit = AdmissionLimits(max_inflight=2)
    assert fleet_limit.why_no_room([ReplicaLoad("a")], 1, 0) is None
    assert "admission_max_inflight 2" in str(fleet_limit.why_no_room([ReplicaLoad("a")], 2, 0))
    both = AdmissionLimits(max_inflight_per_replica=1, max_queued_prefill_s=0.5)
    full = [ReplicaLoad("a", 1, 0.0), ReplicaLoad("b", 0, 0.7)]
    assert str(both.why_no_room(full, 1, 0)) == (
        "every replica that serves the model is at its limit "
        "(admission_max_inflight_per_replica 1, admission_max_queued_prefill_s 0.5)")
    assert "on their way" in str(both.why_no_room([ReplicaLoad("a")], 1, 1))
    assert both.why_no_room([], 0, 0) == "no replica serves the model"


# -- the queue ----------------------------------------------------------------------------------


def _queue(length: int = 3, wait_s: float = 10.0) -> AdmissionQueue:
    return AdmissionQueue(AdmissionLimits(max_inflight=1, max_queue_length=length,
                                          max_queue_wait_s=wait_s))


def test_the_queue_keeps_the_configured_order_its_aging_and_weights() -> None:
    """An empty ``FairOrder`` is falsy (``__len__``): the queue once replaced the configured one
    with the default, so aging never lifted a starved class and tenant weights did nothing (a
    reviewer's live finding: batch waited 44 s of a 45 s flood, weights 3:1 served 50/50)."""
    order = FairOrder(aging_s=1.0, weight_of=lambda tenant: 3.0 if tenant == "a" else 1.0)
    q = AdmissionQueue(AdmissionLimits(max_inflight=1, max_queue_length=10,
                                       max_queue_wait_s=100.0), order)
    assert q.order is order
    # aging: a batch request (rank 2) waiting 2.5 s goes before a standard one (rank 1) just come
    assert q.offer(q.new_entry("batch", None, 0.0, cost_s=1.0, priority=2))
    assert q.offer(q.new_entry("standard", None, 2.4, cost_s=1.0, priority=1))
    first = q.pop_next(lambda entry: True, now=2.5)
    assert first is not None and first.request_id == "batch"
    # weights 3:1 between two tenants of one class, both always waiting: about 3 to 1 served
    q = AdmissionQueue(AdmissionLimits(max_inflight=1, max_queue_length=100,
                                       max_queue_wait_s=100.0),
                       FairOrder(weight_of=lambda tenant: 3.0 if tenant == "a" else 1.0))
    for i in range(40):
        for tenant in ("a", "b"):
            assert q.offer(q.new_entry(f"{tenant}{i}", None, 0.0, cost_s=0.01, tenant=tenant))
    served = [q.pop_next(lambda entry: True, now=0.0) for _ in range(40)]
    share_a = sum(1 for e in served if e is not None and e.tenant == "a") / len(served)
    assert 0.7 <= share_a <= 0.8, share_a


def test_queue_bounded_in_length() -> None:
    q = _queue(length=2)
    assert q.offer(q.new_entry("r1", None, 0.0))
    assert q.offer(q.new_entry("r2", None, 0.0))
    third = q.new_entry("r3", None, 0.0)
    assert not q.offer(third)
    assert len(q) == 2 and not third.queued


def test_pop_next_in_arrival_order_skipping_what_does_not_fit() -> None:
    q = _queue()
    a, b, c = (q.new_entry(f"r{i}", model, float(i)) for i, model in
               enumerate(("full-model", "m", "m")))
    for e in (a, b, c):
        q.offer(e)
    fits = lambda e: e.model == "m"  # noqa: E731
    assert q.pop_next(fits, 0.0) is b
    assert q.pop_next(fits, 0.0) is c
    assert q.pop_next(fits, 0.0) is None
    assert [e.request_id for e in q] == ["r0"] and q.models() == ["full-model"]
    assert q.pop_next(lambda e: True, 0.0) is a and not a.queued and len(q) == 0
    assert q.models() == []


def test_remove_takes_out_once() -> None:
    q = _queue()
    a, b = q.new_entry("a", None, 0.0), q.new_entry("b", None, 1.0)
    q.offer(a)
    q.offer(b)
    assert q.remove(a) and not q.remove(a)
    assert [e.request_id for e in q] == ["b"]
    assert q.next_deadline() == pytest.approx(11.0)  # a's deadline left with it


def test_expire_at_the_deadline_only() -> None:
    q = _queue(wait_s=5.0)
    a, b = q.new_entry("a", None, 0.0), q.new_entry("b", None, 2.0)
    q.offer(a)
    q.offer(b)
    assert q.expire(4.999) == []
    assert q.expire(5.0) == [a]
    assert q.oldest_wait_s(6.0) == pytest.approx(4.0)
    assert q.expire(100.0) == [b]
    assert q.next_deadline() is None and q.oldest_wait_s(100.0) == 0.0


def test_retry_after_from_the_drain_rate() -> None:
    q = _queue(length=100, wait_s=30.0)
    assert q.retry_after_s(0.0) == 30  # nothing admitted yet: the wait bound
    for i in range(20):  # 2 admissions/s over the window
        q.record_admission(0.5 + i * 0.5)
    for i in range(9):
        q.offer(q.new_entry(f"r{i}", None, 10.0))
    assert q.retry_after_s(10.0) == 5  # (9 waiting + 1) / 2 per s
    assert q.retry_after_s(10.0, ahead=1) == 1  # never below 1
    assert q.retry_after_s(10.0, ahead=10_000) == RETRY_AFTER_MAX_S
    assert q.retry_after_s(100.0) == 30  # the window passed: no rate known


# -- the gate -----------------------------------------------------------------------------------


class Fleet:
    """Loads the test sets: one replica, ``inflight`` of this router's requests on it."""

    def __init__(self) -> None:
        self.inflight = 0
        self.routable = True

    def loads_of(self, model: str | None) -> list[ReplicaLoad] | None:
        return [ReplicaLoad("a", self.inflight)] if self.routable else None


def _gate(**limits: float) -> tuple[AdmissionGate, Fleet, list[AdmissionEvent]]:
    """A gate with ``limits`` on a ``Fleet``, and the list of the events it reports."""
    fleet, events = Fleet(), list[AdmissionEvent]()
    gate = AdmissionGate(AdmissionLimits(**limits), fleet.loads_of, events.append)  # type: ignore[arg-type]
    return gate, fleet, events


async def test_gate_off_admits_everything() -> None:
    gate, _, _ = _gate()
    slots = [await gate.admit(f"r{i}", None) for i in range(100)]
    assert len(slots) == 100 and len(gate.queue) == 0


async def test_gate_queues_until_a_slot_is_released_in_order() -> None:
    gate, _fleet, events = _gate(max_inflight=2)
    first = [await gate.admit(f"r{i}", None) for i in range(2)]
    waiters = [asyncio.create_task(gate.admit(f"w{i}", None)) for i in range(3)]
    await asyncio.sleep(0)
    assert len(gate.queue) == 3 and not any(w.done() for w in waiters)
    first[0].release()
    first[0].release()  # idempotent: frees one slot only
    await asyncio.wait_for(waiters[0], 5)
    await asyncio.sleep(0.01)
    assert not waiters[1].done() and gate.num_admitted == 2
    first[1].release()
    await asyncio.wait_for(waiters[1], 5)
    assert not waiters[2].done()
    assert [e.outcome for e in events] == ["admitted"] * 4
    assert [e.queued for e in events] == [False, False, True, True]
    waiters[2].cancel()


async def test_gate_per_replica_room_follows_dispatch() -> None:
    gate, fleet, _events = _gate(max_inflight_per_replica=1)
    slot = await gate.admit("r0", None)
    waiter = asyncio.create_task(gate.admit("r1", None))
    await asyncio.sleep(0.01)
    assert not waiter.done()  # admitted, not dispatched: it holds the replica's one slot
    fleet.inflight = 1
    slot.dispatched()
    await asyncio.sleep(0.01)
    assert not waiter.done()  # now counted in the replica's load
    fleet.inflight = 0
    slot.release()
    second = await asyncio.wait_for(waiter, 5)
    assert second.waited_s > 0


async def test_gate_cancelled_waiter_leaves_the_queue_at_once() -> None:
    gate, _fleet, events = _gate(max_inflight=1)
    slot = await gate.admit("r0", None)
    waiter = asyncio.create_task(gate.admit("gone", None))
    later = asyncio.create_task(gate.admit("later", None))
    await asyncio.sleep(0)
    assert len(gate.queue) == 2
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert len(gate.queue) == 1 and events[-1].outcome == "cancelled"
    slot.release()
    await asyncio.wait_for(later, 5)  # the slot went to the next one, not to the gone client
    assert gate.num_admitted == 1


async def test_gate_admitted_as_the_client_left_gives_the_slot_back() -> None:
    gate, _fleet, _events = _gate(max_inflight=1)
    slot = await gate.admit("r0", None)
    waiter = asyncio.create_task(gate.admit("r1", None))
    await asyncio.sleep(0)
    slot.release()
    gate._pump()  # admitted now, before the waiter's task resumes
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.num_admitted == 0 and gate.num_pending == 0


async def test_gate_sheds_past_the_wait_bound_with_retry_after() -> None:
    gate, _fleet, events = _gate(max_inflight=1, max_queue_wait_s=0.05)
    slot = await gate.admit("r0", None)
    with pytest.raises(Overloaded) as info:
        await asyncio.wait_for(gate.admit("r1", None), 10)
    exc = info.value
    assert exc.status == 503 and exc.reason == SHED_QUEUE_TIMEOUT
    assert int(exc.headers[RETRY_AFTER_HEADER]) >= 1
    assert events[-1].outcome == "shed" and events[-1].waited_s >= 0.05
    assert len(gate.queue) == 0 and gate.num_admitted == 1
    slot.release()


async def test_gate_sheds_when_the_queue_is_full() -> None:
    gate, _fleet, _events = _gate(max_inflight=1, max_queue_length=1)
    await gate.admit("r0", None)
    waiter = asyncio.create_task(gate.admit("r1", None))
    await asyncio.sleep(0)
    with pytest.raises(Overloaded) as info:
        await gate.admit("r2", None)
    assert info.value.reason == SHED_QUEUE_FULL and info.value.status == 503
    assert RETRY_AFTER_HEADER in info.value.headers
    waiter.cancel()


async def test_gate_admits_an_unroutable_model_at_once() -> None:
    # routing answers its 404/503; waiting for room that cannot come would only delay it
    gate, fleet, _events = _gate(max_inflight_per_replica=1)
    await gate.admit("r0", None)
    fleet.routable = False
    await asyncio.wait_for(gate.admit("r1", None), 5)


async def test_gate_explains_why_a_request_would_wait() -> None:
    gate, fleet, _events = _gate(max_inflight_per_replica=1)
    assert gate.explain(None) == {"admit": True, "wait_reason": None, "replicas": {"a": {
        "inflight_requests": 0, "queued_prefill_s": 0.0, "room": True}}, "ttft_target_s": None,
        "predicted_ttft_s": None, "slo": None, "slo_reason": None}
    fleet.inflight = 1
    waiter = asyncio.create_task(gate.admit("r0", None))
    await asyncio.sleep(0)
    explained = gate.explain(None)
    assert not explained["admit"] and explained["replicas"]["a"]["room"] is False
    assert explained["wait_reason"].startswith("1 requests wait in the admission queue; every "
                                               "replica that serves the model is at its limit")
    waiter.cancel()


async def test_gate_polls_for_room_it_is_not_told_of() -> None:
    gate, fleet, _events = _gate(max_inflight_per_replica=1)
    fleet.inflight = 1  # another path's load (the replica was full when it came)
    waiter = asyncio.create_task(gate.admit("r0", None))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    fleet.inflight = 0  # freed without a kick
    await asyncio.wait_for(waiter, 5)


# -- settings -----------------------------------------------------------------------------------


def test_admission_settings_through_the_one_mechanism(tmp_path: Path) -> None:
    from router.service.config import ConfigError, load_config

    base = ["--replica", "http://127.0.0.1:9"]
    assert not load_config(base, env={}).admission_limits().enabled  # off by default
    path = tmp_path / "router.yaml"
    path.write_text("admission_max_inflight: 10\nadmission_max_queue_wait_s: 2.5\n")
    cfg = load_config([*base, "--config", str(path), "--admission-max-inflight-per-replica", "3"],
                      env={"ROUTER_ADMISSION_MAX_QUEUE_LENGTH": "7",
                           "ROUTER_ADMISSION_MAX_INFLIGHT": "12"})
    assert cfg.admission_limits() == AdmissionLimits(12, 3, 0.0, 7, 2.5)
    for flag, value in (("--admission-max-inflight", "-1"), ("--admission-max-queue-length", "0"),
                        ("--admission-max-queue-wait-s", "0"),
                        ("--admission-max-queued-prefill-s", "-0.5")):
        with pytest.raises(ConfigError, match=flag.removeprefix("--").replace("-", "_")):
            load_config([*base, flag, value], env={})
