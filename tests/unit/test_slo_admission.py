"""SLO-aware admission (issue 33): a TTFT target per priority class. The verdict table of
``router.traffic.admission.slo_verdict``, the gate holding, admitting and shedding by it on a
real event loop with loads and a clock the test sets, and the targets' settings."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from router.service.config import ConfigError, RouterConfig
from router.traffic.admission import (
    RETRY_AFTER_HEADER,
    SHED_TTFT_TARGET,
    SLO_MEETS,
    SLO_SHED,
    SLO_UNMEETABLE,
    SLO_WAIT,
    AdmissionLimits,
    Overloaded,
    ReplicaLoad,
    slo_verdict,
)
from router.traffic.classes import (
    TenantFileError,
    load_tenant_file,
    parse_ttft_targets,
    priority_classes,
)
from router.traffic.gate import AdmissionEvent, AdmissionGate

S_PER_TOKEN = 1e-3  # seconds per work token: 1,000 work tokens are 1 s of prefill


def _load(rid: str, queued_s: float, inflight: int = 0) -> ReplicaLoad:
    return ReplicaLoad(rid, inflight, queued_s, S_PER_TOKEN, 0.1)


# -- the verdict ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("queued_s", "waited_s", "work", "outcome", "predicted"), [
    ((0.5, 3.0), 0.0, 1000, SLO_MEETS, 1.6),  # best replica: 0.1 + 0.5 + 1.0
    ((2.0, 3.0), 0.0, 1000, SLO_WAIT, 3.1),  # 3.1 > 2 s; idle (1.1 s) could still meet it
    ((2.0, 3.0), 0.8, 1000, SLO_WAIT, 3.1),  # waited 0.8 + idle 1.1 <= 2
    ((2.0, 3.0), 1.0, 1000, SLO_SHED, 3.1),  # waited 1.0 + idle 1.1 > 2: can no longer meet it
    ((0.0, 0.0), 0.0, 2500, SLO_UNMEETABLE, 2.6),  # its own prefill alone misses it
])
def test_verdict_table(queued_s: tuple[float, float], waited_s: float, work: float,
                       outcome: str, predicted: float) -> None:
    loads = [_load("a", queued_s[0]), _load("b", queued_s[1])]
    verdict = slo_verdict(AdmissionLimits(max_inflight=1), loads, work, 2.0, waited_s)
    assert verdict.outcome == outcome
    assert verdict.predicted_ttft_s == pytest.approx(predicted)
    assert verdict.idle_ttft_s == pytest.approx(0.1 + work * S_PER_TOKEN)
    assert str(2) in verdict.why(2.0, waited_s)


def test_verdict_counts_only_replicas_with_room() -> None:
    limits = AdmissionLimits(max_inflight_per_replica=1)
    loads = [_load("a", 0.0, inflight=1), _load("b", 5.0)]  # a is idle of prefill but full
    verdict = slo_verdict(limits, loads, 100, 2.0, 0.0)
    assert verdict.outcome == SLO_WAIT and verdict.predicted_ttft_s == pytest.approx(5.2)
    full = slo_verdict(limits, [_load("a", 0.0, inflight=1)], 100, 2.0, 0.0)
    assert full.outcome == SLO_WAIT and math.isinf(full.predicted_ttft_s)


# -- the gate ------------------------------------------------------------------------------------


class Fleet:
    """Two replicas whose queued prefill (seconds) the test sets; a clock it advances."""

    def __init__(self) -> None:
        self.queued_s = [0.0, 0.0]
        self.now = 100.0

    def loads_of(self, model: str | None) -> list[ReplicaLoad]:
        return [_load(rid, q) for rid, q in zip("ab", self.queued_s, strict=True)]

    def clock(self) -> float:
        return self.now


def _gate(queued_s: tuple[float, float] = (0.0, 0.0),
          ) -> tuple[AdmissionGate, Fleet, list[AdmissionEvent]]:
    """A gate on a ``Fleet`` whose replicas have ``queued_s`` of prefill queued, and the list of
    the events it reports."""
    fleet, events = Fleet(), list[AdmissionEvent]()
    fleet.queued_s = list(queued_s)
    gate = AdmissionGate(AdmissionLimits(max_inflight=100), fleet.loads_of, events.append,
                         clock=fleet.clock)
    return gate, fleet, events


async def _settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_gate_holds_a_request_for_its_target_then_admits_it() -> None:
    gate, fleet, events = _gate((3.0, 4.0))
    waiter = asyncio.create_task(gate.admit("r0", None, 1.0, 0, "", 1000, 2.0))
    await _settle()
    assert not waiter.done() and len(gate.queue) == 1  # predicted 4.1 s > 2 s: it waits
    assert not gate.explain(None, 0, 1000, 2.0)["admit"]
    fleet.queued_s = [0.5, 4.0]  # replica a reached its first tokens
    fleet.now += 0.5  # waited 0.5 + predicted 1.6 > 2: still waits
    gate.kick()
    await _settle()
    assert not waiter.done()
    fleet.queued_s = [0.2, 4.0]  # 0.5 + 1.3 <= 2
    gate.kick()
    slot = await asyncio.wait_for(waiter, 5)
    assert slot.waited_s == pytest.approx(0.5)
    assert (events[-1].outcome, events[-1].slo) == ("admitted", "waited")
    assert events[-1].predicted_ttft_s == pytest.approx(1.3)
    # its prefill counts against the next targeted request until it is dispatched
    assert gate.pending_prefill_s == pytest.approx(1.1)
    slot.dispatched()
    assert gate.pending_prefill_s == 0.0


async def test_gate_counts_prefill_admitted_but_not_dispatched() -> None:
    gate, _fleet, events = _gate()
    # each request predicts 0.6 s on an idle replica; those admitted before it and not yet
    # dispatched add their 0.6 s spread over the two replicas: the k-th (from 0) sees
    # 0.6 + 0.3 k, within 2 s for k <= 4
    slots = [await asyncio.wait_for(gate.admit(f"r{k}", None, 1.0, 0, "", 500, 2.0), 5)
             for k in range(5)]
    assert [e.slo for e in events] == [SLO_MEETS] * 5
    assert events[-1].predicted_ttft_s == pytest.approx(1.8)
    sixth = asyncio.create_task(gate.admit("r5", None, 1.0, 0, "", 500, 2.0))  # 2.1 s
    await _settle()
    assert not sixth.done()
    slots[0].dispatched()  # (the test's loads stay idle: as if it reached its first token)
    await asyncio.wait_for(sixth, 5)


async def test_a_held_request_holds_back_lower_classes_not_higher() -> None:
    gate, fleet, events = _gate((3.0, 3.0))
    held = asyncio.create_task(gate.admit("mid", None, 1.0, 1, "", 1000, 2.0))
    await _settle()
    lower = asyncio.create_task(gate.admit("low", None, 1.0, 2, ""))  # no target
    higher = asyncio.create_task(gate.admit("high", None, 1.0, 0, ""))  # no target
    fleet.now += 0.1
    gate.kick()
    await asyncio.wait_for(higher, 5)
    await _settle()
    assert not lower.done() and not held.done()  # the lower class waits behind the held one
    fleet.queued_s = [0.0, 0.0]
    fleet.now += 0.1
    gate.kick()
    await asyncio.wait_for(held, 5)
    await asyncio.wait_for(lower, 5)
    assert [e.tenant or e.priority for e in events if e.outcome == "admitted"] == [0, 1, 2]


async def test_gate_sheds_once_the_target_cannot_be_met() -> None:
    gate, fleet, events = _gate((3.0, 3.0))
    waiter = asyncio.create_task(gate.admit("r0", None, 1.0, 0, "t", 1000, 2.0))
    await _settle()
    fleet.now += 0.8  # waited 0.8 + idle 1.1 <= 2: still waits
    gate.kick()
    await _settle()
    assert not waiter.done()
    fleet.now += 0.2  # 1.0 + 1.1 > 2: shed
    gate.kick()
    with pytest.raises(Overloaded) as info:
        await asyncio.wait_for(waiter, 5)
    assert info.value.reason == SHED_TTFT_TARGET and info.value.status == 503
    assert int(info.value.headers[RETRY_AFTER_HEADER]) >= 1
    assert "can no longer be met" in str(info.value)
    assert len(gate.queue) == 0
    assert (events[-1].outcome, events[-1].reason, events[-1].slo) == ("shed", SHED_TTFT_TARGET,
                                                                        SLO_SHED)


async def test_a_request_its_own_prefill_misses_is_judged_by_the_limits_alone() -> None:
    gate, _fleet, events = _gate()
    await asyncio.wait_for(gate.admit("big", None, 5.0, 0, "", 5000, 2.0), 5)
    assert events[-1].slo == SLO_UNMEETABLE


async def test_no_target_no_slo() -> None:
    gate, _fleet, events = _gate((30.0, 30.0))
    await asyncio.wait_for(gate.admit("r0", None, 1.0, 0, "", 1000), 5)
    assert (events[-1].slo, events[-1].predicted_ttft_s) == ("", None)


# -- the targets' settings -----------------------------------------------------------------------


def test_targets_from_settings_and_the_tenant_file(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  chat: {priority_class: interactive, ttft_targets_s: "
                    "{Interactive: 0.5}}\n  etl: {priority_class: batch}\n")
    classes = priority_classes(("interactive", "standard", "batch"), "standard",
                               load_tenant_file(str(path)), ("interactive=2", "batch=60.5"))
    assert classes.ttft_target_s(0, "chat") == 0.5  # the tenant's own
    assert classes.ttft_target_s(0, "etl") == 2.0  # the router's, by class
    assert classes.ttft_target_s(2, None) == 60.5
    assert classes.ttft_target_s(1, "chat") is None  # no target for standard


@pytest.mark.parametrize("bad", [("interactive",), ("interactive=x",), ("interactive=0",),
                                 ("nope=1",), ("batch=1", "batch=2"), ("batch=inf",)])
def test_bad_targets_refused_naming_the_setting(bad: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        RouterConfig(replicas=("http://127.0.0.1:1",), admission_ttft_targets=bad)
    assert info.value.args[0].startswith("admission_ttft_targets")


def test_target_list_parsed() -> None:
    assert parse_ttft_targets([" Interactive = 1.5 "]) == {"interactive": 1.5}


def test_bad_tenant_targets_refused(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("tenants:\n  chat: {ttft_targets_s: [1, 2]}\n")
    with pytest.raises(TenantFileError, match="ttft_targets_s"):
        load_tenant_file(str(path))
    path.write_text("tenants:\n  chat: {ttft_targets_s: {nope: 1}}\n")
    with pytest.raises(ValueError, match="nope"):
        priority_classes(("interactive",), "interactive", load_tenant_file(str(path)))
