"""Block index: set semantics, hit depths from the front of the chain, speculative placements."""

from __future__ import annotations

import pytest

from router.decision.index import BlockIndex, SpeculativePlacements


def make() -> BlockIndex:
    index = BlockIndex()
    index.add("a", [1, 2, 3, 4])
    index.add("b", [1, 2, 9])
    index.add("c", [2, 3])  # holds no leading key
    return index


def test_hit_depths_count_leading_keys_only() -> None:
    index = make()
    mask = index.mask_of(["a", "b", "c"])
    confirmed, combined = index.hit_depths([1, 2, 3, 4, 5], mask)
    assert confirmed == {"a": 4, "b": 2, "c": 0}
    assert combined == confirmed
    assert index.hit_depths([], mask)[0] == {"a": 0, "b": 0, "c": 0}
    assert index.hit_depths([1, 2, 3, 4], index.mask_of(["a"]))[0] == {"a": 4}


def test_add_is_idempotent_and_remove_clear_drop() -> None:
    index = make()
    index.add("a", [1, 2])
    assert index.num_blocks("a") == 4 and len(index) == 5
    index.remove("a", [2, 77])
    assert index.num_blocks("a") == 3
    assert index.hit_depths([1, 2, 3], index.mask_of(["a"]))[0] == {"a": 1}
    index.clear("b")
    assert index.num_blocks("b") == 0
    assert index.hit_depths([1], index.mask_of(["b"]))[0] == {"b": 0}
    index.drop("c")
    assert "c" not in index.replicas()
    assert index.sweep_pending
    assert sorted(index.sweep_all()) == [1, 2]  # b's old slot and c's slot
    assert len(index) == 3  # keys 1, 3, 4 of replica a remain
    index.add("d", [1])  # reuses a freed slot without inheriting its keys
    assert index.hit_depths([1, 2], index.mask_of(["a", "d"]))[0] == {"a": 1, "d": 1}
    index.remove("unknown", [1])


def test_replace_sets_snapshot_and_epoch() -> None:
    index = make()
    index.replace("a", [7, 8], epoch=3)
    assert index.epochs["a"] == 3 and index.num_blocks("a") == 2
    assert index.hit_depths([1], index.mask_of(["a"]))[0] == {"a": 0}


def test_speculative_extends_combined_until_expiry() -> None:
    index = make()
    spec = SpeculativePlacements(ttl_s=10.0)
    spec.place(index.bit("b"), [3, 4, 5], now=100.0)
    mask = index.mask_of(["a", "b"])
    confirmed, combined = index.hit_depths([1, 2, 3, 4, 5], mask, spec, now=105.0)
    assert confirmed == {"a": 4, "b": 2}
    assert combined == {"a": 4, "b": 5}
    _, later = index.hit_depths([1, 2, 3, 4, 5], mask, spec, now=110.0)
    assert later == {"a": 4, "b": 2}
    assert spec.prune(110.0) == 3 and len(spec) == 0


def test_speculative_forget_bit_and_bad_ttl() -> None:
    spec = SpeculativePlacements(ttl_s=1.0)
    spec.place(0, [1, 2], now=0.0)
    spec.place(1, [2], now=0.0)
    spec.forget_bit(0)
    assert len(spec) == 1
    with pytest.raises(ValueError):
        SpeculativePlacements(ttl_s=0)


def test_clear_is_immediate_and_sweep_is_incremental() -> None:
    index = BlockIndex()
    index.add("a", range(1000))
    index.add("b", range(500, 1500))
    old_slot = index.bit("a")
    index.clear("a")  # O(1): a fresh slot
    assert index.bit("a") != old_slot and index.num_blocks("a") == 0
    mask = index.mask_of(["a", "b"])
    assert index.hit_depths([0, 1, 2], mask)[0] == {"a": 0, "b": 0}
    assert index.hit_depths(list(range(500, 510)), mask)[0] == {"a": 0, "b": 10}
    index.add("a", [5000, 5001])  # new events while the sweep runs
    steps = 0
    freed: list[int] = []
    while index.sweep_pending:
        freed += index.sweep_step(max_keys=100)
        index.add("c", [10_000 + steps])  # keys added mid-sweep are never swept away
        steps += 1
    assert freed == [old_slot] and steps > 5
    assert len(index) == 1000 + 2 + steps  # b's 1000, a's 2 new, c's
    assert index.hit_depths([5000, 5001], index.mask_of(["a"]))[0] == {"a": 2}
    assert index.num_blocks("c") == steps
    index.add("d", [0])  # takes the freed slot, and inherits nothing
    assert index.bit("d") == old_slot
    assert index.hit_depths([0, 1], index.mask_of(["d"]))[0] == {"d": 1}


def test_retired_slots_are_not_reused_before_their_sweep() -> None:
    index = BlockIndex()
    for rid in "abc":
        index.add(rid, [1, 2, 3])
    index.clear("a")
    index.drop("b")
    index.add("e", [9])
    slots = {index.bit(r) for r in ("a", "c", "e")}
    assert len(slots) == 3 and not slots & {0, 1}  # a's and b's old slots are still retired
    index.sweep_all()
    assert index.hit_depths([1, 2, 3], index.mask_of(["a", "c", "e"]))[0] == {"a": 0, "c": 3, "e": 0}
    assert len(index) == 4
