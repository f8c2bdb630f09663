"""Ring: deterministic, even spread, ~1/R keys move when a replica joins or leaves."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.decision.ring import HashRing, mix64, text_key

_RNG = random.Random(7)
KEYS = [_RNG.getrandbits(64) for _ in range(20000)]


def test_order_lists_every_replica_once_and_is_deterministic() -> None:
    ring = HashRing([f"replica-{i}" for i in range(8)], vnodes=64)
    again = HashRing([f"replica-{i}" for i in reversed(range(8))], vnodes=64)
    for key in KEYS[:200]:
        order = ring.order(key)
        assert sorted(order) == sorted(ring.replica_ids)
        assert order == again.order(key)
        assert ring.home(key) == order[0]


def test_spread_is_even() -> None:
    ring = HashRing([f"replica-{i}" for i in range(8)], vnodes=128)
    counts = Counter(ring.home(k) for k in KEYS)
    mean = len(KEYS) / 8
    assert max(counts.values()) / mean < 1.25
    assert min(counts.values()) / mean > 0.75


@pytest.mark.parametrize("change", ["add", "remove"])
def test_membership_change_moves_about_one_over_r(change: str) -> None:
    ids = [f"replica-{i}" for i in range(8)]
    before = HashRing(ids)
    after = HashRing([*ids, "replica-8"]) if change == "add" else HashRing(ids[:-1])
    moved = sum(before.home(k) != after.home(k) for k in KEYS) / len(KEYS)
    assert 0.06 < moved < 0.2  # ~1/9 or ~1/8
    if change == "remove":  # only the removed replica's keys move
        assert all(after.home(k) == before.home(k) for k in KEYS if before.home(k) != "replica-7")


def test_empty_ring_and_bad_vnodes() -> None:
    assert HashRing([]).order(5) == ()
    assert HashRing([]).home(5) is None
    with pytest.raises(ValueError):
        HashRing(["a"], vnodes=0)


def test_mix_and_text_key_are_stable() -> None:
    assert mix64(0) != mix64(1)
    assert 0 <= mix64(2**64 - 1) < 2**64
    assert text_key("hello") == text_key("hello") != text_key("hello!")
