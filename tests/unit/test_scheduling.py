"""Admission order (issue 33, step 2): priority classes with aging, deficit round robin between
tenants over predicted prefill seconds. Pure tables for ``router.traffic.scheduling``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from router.traffic.scheduling import FairOrder

_SEQ = itertools.count()


@dataclass(eq=False)
class E:
    tenant: str = ""
    priority: int = 0
    cost_s: float = 0.1
    enqueued_at: float = 0.0
    model: str = "m"
    seq: int = 0

    def __post_init__(self) -> None:
        self.seq = next(_SEQ)


def every(entry: object) -> bool:
    return True


def of_model_m(entry: Any) -> bool:
    return bool(entry.model == "m")


def drain(order: FairOrder, now: float = 0.0,
          fits: Callable[[Any], bool] = every) -> list[Any]:
    out = []
    while (entry := order.pop(fits, now)) is not None:
        out.append(entry)
    return out


def test_one_class_one_tenant_is_arrival_order() -> None:
    order = FairOrder()
    entries = [E(cost_s=c) for c in (0.5, 0.0, 2.0, 0.1)]
    for e in entries:
        order.add(e)
    assert drain(order) == entries and len(order) == 0


def test_requests_that_do_not_fit_are_passed_over() -> None:
    order = FairOrder()
    a, b, c = E(model="full"), E(), E()
    for e in (a, b, c):
        order.add(e)
    assert drain(order, fits=of_model_m) == [b, c]
    assert order.pop(of_model_m, 0.0) is None and len(order) == 1
    assert drain(order) == [a]


def test_classes_in_strict_order_without_aging() -> None:
    order = FairOrder()
    low, mid, high = E(priority=2), E(priority=1), E(priority=0, enqueued_at=50.0)
    for e in (low, mid, high):
        order.add(e)
    assert drain(order, now=1e6) == [high, mid, low]


def test_a_higher_class_that_does_not_fit_lets_a_lower_one_through() -> None:
    order = FairOrder()
    high, low = E(priority=0, model="full"), E(priority=1)
    order.add(high)
    order.add(low)
    assert order.pop(of_model_m, 0.0) is low


@pytest.mark.parametrize(("now", "first"), [(9.9, "high"), (10.0, "low"), (25.0, "low")])
def test_aging_raises_a_class_one_rank_per_aging_period(now: float, first: str) -> None:
    # the low class (rank 1) waited since 0; the high one's request came at 5: after 10 s the
    # low class's rank is 0 too, and its longer wait goes first
    order = FairOrder(aging_s=10.0)
    low, high = E(priority=1, enqueued_at=0.0), E(priority=0, enqueued_at=5.0)
    order.add(low)
    order.add(high)
    assert order.pop(every, now) is (high if first == "high" else low)


def test_aging_never_starves_the_lowest_class() -> None:
    order = FairOrder(aging_s=1.0)
    batch = E(priority=2, enqueued_at=0.0)
    order.add(batch)
    served = []
    for t in range(10):  # a new interactive request every second, each admitted at once
        order.add(E(priority=0, enqueued_at=float(t)))
        served.append(order.pop(every, float(t)))
    assert batch in served[:3]  # rank 2 -> 0 after 2 s, and it waited longer


def _served_share(order: FairOrder, offered: dict[str, int], cost_s: dict[str, float],
                  num_pops: int) -> dict[str, float]:
    """Keep every tenant backlogged with ``offered[t]`` requests waiting; the prefill seconds
    each gets over ``num_pops`` admissions, as shares."""
    waiting = dict.fromkeys(offered, 0)
    served = dict.fromkeys(offered, 0.0)
    for _ in range(num_pops):
        for tenant, n in offered.items():
            while waiting[tenant] < n:
                order.add(E(tenant=tenant, cost_s=cost_s[tenant]))
                waiting[tenant] += 1
        entry = order.pop(every, 0.0)
        assert entry is not None
        waiting[entry.tenant] -= 1
        served[entry.tenant] += entry.cost_s
    total = sum(served.values())
    return {t: s / total for t, s in served.items()}


def test_equal_weights_share_prefill_seconds_equally_whatever_the_sizes() -> None:
    share = _served_share(FairOrder(), {"small": 20, "large": 2},
                          {"small": 0.02, "large": 1.3}, 2_000)
    assert share["small"] == pytest.approx(0.5, abs=0.03)


def test_three_times_the_offered_load_gets_no_more_than_its_share() -> None:
    # the target: tenants offering 1x and 3x their share each get >= 45% of the prefill
    share = _served_share(FairOrder(), {"a": 1, "b": 3}, {"a": 0.2, "b": 0.2}, 1_000)
    assert min(share.values()) >= 0.45


def test_weights_divide_the_fleet() -> None:
    weights = {"gold": 3.0, "bronze": 1.0}
    share = _served_share(FairOrder(weight_of=weights.__getitem__), {"gold": 4, "bronze": 4},
                          {"gold": 0.3, "bronze": 0.1}, 3_000)
    assert share["gold"] == pytest.approx(0.75, abs=0.03)


def test_an_emptied_tenant_loses_its_deficit() -> None:
    order = FairOrder(quantum_s=1.0)
    order.add(E(tenant="a", cost_s=0.1))
    assert drain(order) and len(order) == 0  # "a" was credited 1 s and used 0.1 s
    b1, a1 = E(tenant="b", cost_s=0.5), E(tenant="a", cost_s=0.5)
    order.add(b1)
    order.add(a1)
    # had "a" kept its 0.9 s, its request would go at its first turn, before "b"'s second
    assert drain(order) == [b1, a1]


def test_a_huge_request_takes_few_steps() -> None:
    order = FairOrder(quantum_s=1e-6)
    huge = E(cost_s=1e6)
    order.add(huge)
    assert order.pop(every, 0.0) is huge  # credited in bulk, not in 1e12 turns


def test_remove_and_bad_input() -> None:
    order = FairOrder()
    a, b = E(tenant="t"), E(tenant="t")
    order.add(a)
    order.add(b)
    order.remove(a)
    assert list(order) == [b]
    with pytest.raises(KeyError):
        order.remove(a)
    with pytest.raises(ValueError):
        order.add(E(priority=-1))
    with pytest.raises(ValueError):
        order.add(E(cost_s=float("nan")))
    for bad in ({"aging_s": -1.0}, {"quantum_s": 0.0}):
        with pytest.raises(ValueError):
            FairOrder(**bad)  # type: ignore[arg-type]
