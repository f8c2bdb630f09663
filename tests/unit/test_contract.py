"""The Redis contract's keys (hash tags, Redis Cluster slots) and the router's entry_seq check."""

from __future__ import annotations

import pytest

from router.shared import contract as c
from tests.unit.test_coarse_index import _beat, _fleet


def test_key_slot_matches_the_cluster_specification() -> None:
    # Redis Cluster specification: CRC16 (XMODEM) of "123456789" is 0x31C3; CLUSTER KEYSLOT foo
    assert c.key_slot("123456789") == 0x31C3
    assert c.key_slot("foo") == 12182
    assert c.key_slot("{user1000}.following") == c.key_slot("{user1000}.followers")
    assert c.key_slot("foo{}{bar}") != c.key_slot("bar")  # an empty tag: the whole key
    assert c.key_slot("foo{{bar}}zap") == c.key_slot("{bar")


@pytest.mark.parametrize("rid", ["replica-0", "10.0.0.5:8000", "a}b", "{x}", "x{y}z", "ü"])
def test_a_replicas_keys_share_one_slot_and_parse_back(rid: str) -> None:
    keys = [c.replica_key("pr", rid), c.blocks_key("pr", rid)]
    assert len({c.key_slot(k) for k in keys}) == 1, keys
    assert c.replica_id_from_key("pr", keys[0]) == (rid, True)
    assert c.replica_id_from_key("pr", f"pr:replica:{rid}".encode()) == (rid, False)
    with pytest.raises(ValueError):
        c.replica_id_from_key("pr", keys[1])
    with pytest.raises(ValueError):
        c.replica_id_from_key("pr", c.events_key("pr"))


def test_an_empty_replica_id_is_refused() -> None:
    with pytest.raises(ValueError):
        c.blocks_key("pr", "")


def test_entries_apply_in_entry_seq_order_and_a_skip_is_a_gap() -> None:
    fleet = _fleet(1)
    _beat(fleet, "r", **{c.F_EPOCH: "5"})
    replica = fleet.replicas["r"]
    fleet.index.replace("r", [1], epoch=5)
    replica.entry_seq = 10  # the loaded set holds entries up to 10
    assert fleet.apply_changes("r", 5, False, [2], [], entry_seq=9) == "duplicate"
    assert fleet.apply_changes("r", 5, False, [3], [], entry_seq=10) == "duplicate"
    assert fleet.apply_changes("r", 5, False, [4], [], entry_seq=11) is None
    assert fleet.apply_changes("r", 5, False, [5], [1], entry_seq=13) == "gap"  # 12 is missing
    assert fleet.index.holds(4) and not fleet.index.holds(5) and fleet.index.holds(1)
    assert replica.entry_seq == 11
    # a newer epoch opens with a full rewrite (cleared), at any entry_seq ...
    assert fleet.apply_changes("r", 6, False, [6], [], entry_seq=12) == "gap"
    assert fleet.apply_changes("r", 6, True, [7], [], entry_seq=12) is None
    assert fleet.index.num_blocks("r") == 1 and fleet.index.holds(7)
    assert fleet.apply_changes("r", 5, False, [8], [], entry_seq=13) == "stale_epoch"
    # ... and entries without entry_seq (versions 1 and 2) are applied unchecked
    assert fleet.apply_changes("r", 6, False, [9], []) is None
    # a set loaded without an entry_seq (-1) takes the next entry as its baseline
    replica.entry_seq = -1
    assert fleet.apply_changes("r", 6, False, [10], [], entry_seq=40) is None
    assert fleet.apply_changes("r", 6, False, [11], [], entry_seq=42) == "gap"
