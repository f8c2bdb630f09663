"""The coarse index (contract version 2): anchor positions, the worker's anchor keys, the
router's hit depths at anchors, merged flush changes and the stride agreement check. Pure."""

from __future__ import annotations

import time

import pytest

from router.decision.fleet import Fleet
from router.decision.index import BlockIndex, SpeculativePlacements
from router.service.config import load_config
from router.shared import contract as c
from router.shared.hashing import BlockHasher
from tests.unit.test_block_set import batch, removed, stored
from worker.flush_batch import net_changes
from worker.replica_view import Change, ReplicaView


def test_anchor_positions_are_a_power_of_two_head_then_every_stride() -> None:
    assert c.anchor_positions(70, 16) == [0, 1, 3, 7, 15, 31, 47, 63]
    assert [d for d in range(70) if c.is_anchor(d, 16)] == c.anchor_positions(70, 16)
    assert list(c.anchor_positions(5, 1)) == [0, 1, 2, 3, 4]
    assert c.anchor_positions(3, 8) == [0, 1]
    assert c.anchor_positions(0, 4) == []
    chain = list(range(100, 140))
    assert c.anchor_keys(chain, 1, 5) == chain[5:]
    assert c.anchor_keys(chain, 8, 4) == [107, 115, 123, 131, 139]


def test_stride_one_index_is_the_exact_index() -> None:
    exact, coarse = BlockIndex(), BlockIndex(1)
    for index in (exact, coarse):
        index.add("a", [1, 2, 3, 4])
    mask = exact.mask_of(["a"])
    assert exact.hit_depths([1, 2, 3, 9], mask) == coarse.hit_depths([1, 2, 3, 9], mask)
    with pytest.raises(ValueError):
        BlockIndex(0)


def test_coarse_hit_depths_end_after_the_deepest_leading_anchor() -> None:
    chain = list(range(1000, 1040))  # 40 blocks; anchors (stride 8) at 0, 1, 3, 7, 15, 23, 31, 39
    index = BlockIndex(8)
    index.add("a", c.anchor_keys(chain[:30], 8))  # holds 30 blocks: anchors up to position 23
    index.add("b", c.anchor_keys(chain[:3], 8))  # 3 blocks: anchors 0 and 1
    index.add("c", c.anchor_keys(chain, 8)[1:])  # lacks block 0
    mask = index.mask_of(["a", "b", "c"])
    confirmed, _ = index.hit_depths(chain, mask)
    assert confirmed == {"a": 24, "b": 2, "c": 0}
    full = BlockIndex(8)
    full.add("a", c.anchor_keys(chain, 8))
    assert full.hit_depths(chain, full.mask_of(["a"]))[0] == {"a": 40}
    # non-anchor keys are never looked up (a worker never publishes them)
    spec = SpeculativePlacements(10.0)
    spec.place(full.bit("a"), [chain[2], chain[4]], now=0.0)
    assert full.hit_depths(chain[:7], full.mask_of(["a"]), spec, now=1.0)[1] == {"a": 4}


def test_worker_publishes_anchor_keys_from_parent_depths() -> None:
    view = ReplicaView(index_stride=4)  # anchors at 0, 1, 3, 7, 11, ...
    first = view.apply_batch(0, batch(stored([10, 11, 12]), stored([13, 14, 15, 16, 17], parent=12)))
    assert first == [Change(c.OP_STORED, [10, 11, 13, 17], 0, 0)]
    # a second request branching after block 1 (depth 2 onwards)
    second = view.apply_batch(1, batch(stored([20, 21], parent=11)))
    assert second == [Change(c.OP_STORED, [21], 0, 1)]
    # removing non-anchors changes nothing visible; removing an anchor does
    assert view.apply_batch(2, batch(removed([16, 15, 14]))) == []
    assert view.apply_batch(3, batch(removed([17]))) == [Change(c.OP_REMOVED, [17], 0, 3)]
    # a parent the view never saw: no depth, nothing published (under-report, never over-report)
    assert view.apply_batch(4, batch(stored([30, 31], parent=999))) == []
    assert view.stats.num_unknown_depth_blocks == 2
    # a reset forgets depths too
    view.reset("gap")
    assert view.apply_batch(5, batch(stored([40], parent=13))) == []


def test_worker_anchor_copies_are_reference_counted() -> None:
    view = ReplicaView(index_stride=4)
    view.apply_batch(0, batch(stored([10, 11]), stored([10, 11])))  # vLLM may store a hash twice
    assert view.apply_batch(1, batch(removed([10, 11]))) == []
    assert view.apply_batch(2, batch(removed([10]))) == [Change(c.OP_REMOVED, [10], 0, 2)]
    # the depth of 11 survived its first removal: a child still gets its anchor
    assert view.apply_batch(3, batch(stored([12, 13], parent=11))) == [Change(c.OP_STORED, [13], 0, 3)]


def test_stride_one_view_publishes_every_key() -> None:
    view = ReplicaView(index_stride=1)
    assert view.apply_batch(0, batch(stored([5, 6, 7], parent=999))) == [
        Change(c.OP_STORED, [5, 6, 7], 0, 0)]


def test_net_changes_keep_each_keys_last_change() -> None:
    changes = [Change(c.OP_STORED, [1, 2, 3], 4, 0), Change(c.OP_REMOVED, [2, 9], 4, 1),
               Change(c.OP_STORED, [9], 4, 2)]
    assert net_changes(changes) == (False, [1, 3, 9], [2])
    reset = [Change(c.OP_CLEARED, [5, 6], 5, 3), Change(c.OP_REMOVED, [6], 5, 4),
             Change(c.OP_STORED, [7], 5, 4)]
    assert net_changes(reset) == (True, [5, 7], [])
    assert net_changes([]) == (False, [], [])


def _fleet(stride: int) -> Fleet:
    config = load_config(["--redis-url", "redis://127.0.0.1:1/0", "--index-stride", str(stride)],
                         env={})
    return Fleet(config, BlockHasher(16, "sha256"))


def _beat(fleet: Fleet, rid: str, key_version: int = c.CONTRACT_VERSION, **fields: str) -> None:
    now = time.time()
    fleet.apply_heartbeat(rid, {c.F_URL: "http://127.0.0.1:1", c.F_HEARTBEAT_TS: str(now),
                                **fields}, now, key_version)


def test_a_replica_with_another_stride_or_another_contract_gets_no_prefix_credit() -> None:
    fleet = _fleet(16)
    now = str(c.CONTRACT_VERSION)
    _beat(fleet, "same", **{c.F_CONTRACT: now, c.F_INDEX_STRIDE: "16"})
    _beat(fleet, "other", **{c.F_CONTRACT: now, c.F_INDEX_STRIDE: "4"})
    _beat(fleet, "old", 1)  # an untagged key without the field: a contract-1 worker, stride 1
    _beat(fleet, "two", **{c.F_CONTRACT: "2", c.F_INDEX_STRIDE: "16"})  # untagged keys
    _beat(fleet, "three", **{c.F_CONTRACT: "3", c.F_INDEX_STRIDE: "16"})  # tiers in one set
    _beat(fleet, "future", **{c.F_CONTRACT: str(c.CONTRACT_VERSION + 1), c.F_INDEX_STRIDE: "16"})
    replicas = fleet.replicas
    assert fleet.config_mismatch(replicas["same"]) is None
    assert fleet.affinity_problem(replicas["same"]) is None
    assert "index_stride 4 != router's 16" in (fleet.affinity_problem(replicas["other"]) or "")
    assert "version 1 is older" in (fleet.config_mismatch(replicas["old"]) or "")
    assert "version 2 is older" in (fleet.config_mismatch(replicas["two"]) or "")
    assert "version 3 is older" in (fleet.config_mismatch(replicas["three"]) or "")
    assert fleet.apply_changes("three", 0, False, [1], []) == "config_mismatch"
    assert "newer" in (fleet.config_mismatch(replicas["future"]) or "")
    # a version-2 worker's entries are not applied (its set, untagged, is never loaded either)
    assert fleet.apply_changes("two", 0, False, [1], []) == "config_mismatch"
    exact = _fleet(1)
    _beat(exact, "tagged", **{c.F_CONTRACT: now})
    assert exact.config_mismatch(exact.replicas["tagged"]) is None
    _beat(exact, "bare")  # a hash-tagged key without the field: taken as this router's version
    assert exact.config_mismatch(exact.replicas["bare"]) is None


def test_router_applies_merged_entries_and_version_one_entries() -> None:
    fleet = _fleet(1)
    _beat(fleet, "r", **{c.F_CONTRACT: str(c.CONTRACT_VERSION), c.F_INDEX_STRIDE: "1"})
    assert fleet.apply_changes("r", 0, False, [1, 2, 3], []) is None
    assert fleet.apply_changes("r", 0, False, [4], [2]) is None
    mask = fleet.index.mask_of(["r"])
    assert fleet.index.hit_depths([1, 3, 4], mask)[0] == {"r": 3}
    assert fleet.apply_changes("r", 0, True, [7], []) is None  # reset, then 7
    assert fleet.index.num_blocks("r") == 1
    assert fleet.apply_event("r", 0, c.OP_STORED, [8]) is None
    assert fleet.apply_event("r", 0, "bogus", [8]) == "bad_op"
    assert fleet.index.hit_depths([7, 8], fleet.index.mask_of(["r"]))[0] == {"r": 2}
