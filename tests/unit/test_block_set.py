"""BlockSet reference counting and ReplicaView event application (pure)."""

from __future__ import annotations

from router.shared.contract import OP_CLEARED, OP_REMOVED, OP_STORED
from router.shared.hashing import BlockHasher, block_key
from router.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from worker.block_keys import RecomputedKeys, UnresolvableEvent
from worker.block_set import BlockSet
from worker.replica_view import NO_SEQ, Change, ReplicaView


def stored(hashes: list[int], parent: int | None = None, tokens: list[int] | None = None,
           block_size: int = 16, lora_name: str | None = None,
           extra_keys: list[list[object] | None] | None = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent,
                       token_ids=tokens if tokens is not None else [0] * block_size * len(hashes),
                       block_size=block_size, lora_id=None, medium="GPU", lora_name=lora_name,
                       extra_keys=extra_keys)


def removed(hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium="GPU")


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> KVEventBatch:
    return KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=0)


def test_store_twice_remove_once_stays_resident() -> None:
    blocks = BlockSet()
    assert blocks.store([1, 2]) == [1, 2]
    assert blocks.store([2, 3]) == [3]
    assert blocks.count(2) == 2
    assert blocks.remove([2]) == []
    assert 2 in blocks
    assert blocks.remove([2, 1]) == [2, 1]
    assert sorted(blocks) == [3]


def test_duplicate_key_within_one_call() -> None:
    blocks = BlockSet()
    assert blocks.store([7, 7]) == [7]
    assert blocks.remove([7]) == []
    assert blocks.remove([7]) == [7]
    assert len(blocks) == 0


def test_unknown_removal_is_ignored_and_counted() -> None:
    blocks = BlockSet([5])
    assert blocks.remove([9]) == []
    assert blocks.num_unknown_removals == 1
    assert blocks.keys() == [5]


def test_clear_returns_resident_and_load_sets_one_copy() -> None:
    blocks = BlockSet()
    blocks.store([1, 1, 2])
    assert sorted(blocks.clear()) == [1, 2]
    assert len(blocks) == 0
    blocks.load([4, 5])
    assert blocks.count(4) == 1
    assert blocks.remove([4]) == [4]


def test_view_merges_runs_and_reports_only_transitions() -> None:
    view = ReplicaView(epoch=3)
    changes = view.apply_batch(0, batch(stored([1, 2]), stored([3], parent=2), stored([1]),
                                        removed([1]), removed([2])))
    assert changes == [Change(OP_STORED, [1, 2, 3], 3, 0), Change(OP_REMOVED, [2], 3, 0)]
    assert view.seq == 0
    assert sorted(view.blocks) == [1, 3]
    assert view.stats.events["BlockStored"] == 3


def test_all_blocks_cleared_supersedes_and_bumps_epoch() -> None:
    view = ReplicaView(epoch=1)
    view.apply_batch(0, batch(stored([1, 2])))
    changes = view.apply_batch(1, batch(stored([3]), AllBlocksCleared(), stored([4])))
    assert changes == [Change(OP_CLEARED, [], 2, 1), Change(OP_STORED, [4], 2, 1)]
    assert view.blocks.keys() == [4]
    assert view.epoch == 2


def test_reset_and_rewrite() -> None:
    view = ReplicaView(epoch=0, seq=NO_SEQ, keys=[1, 2])
    assert view.rewrite("redis came back") == Change(OP_CLEARED, [1, 2], 1, NO_SEQ)
    assert view.reset("gap", seq=9) == Change(OP_CLEARED, [], 2, 9)
    assert len(view.blocks) == 0


def test_bad_hash_is_dropped_and_counted() -> None:
    view = ReplicaView()
    changes = view.apply_batch(0, batch(stored([-5]), stored([6])))
    assert changes == [Change(OP_STORED, [6], 0, 0)]
    assert view.stats.num_bad_events == 1


def test_recomputed_keys_follow_parents_and_removals() -> None:
    """Engine hashed with another seed: the view re-hashes token_ids with the routers' settings."""
    tokens = list(range(1000, 1048))
    engine = BlockHasher(16, "sha256", "123")
    ours = BlockHasher(16, "sha256", None)
    engine_keys = engine.keys(tokens)
    assert engine_keys != ours.keys(tokens)
    view = ReplicaView(mapper=RecomputedKeys(ours, lambda name: None))
    changes = view.apply_batch(0, batch(
        stored(engine_keys[:2], tokens=tokens[:32]),
        stored(engine_keys[2:], parent=engine_keys[1], tokens=tokens[32:48]),
    ))
    assert changes == [Change(OP_STORED, ours.keys(tokens), 0, 0)]
    changes = view.apply_batch(1, batch(removed([engine_keys[2], 12345])))
    assert changes == [Change(OP_REMOVED, [ours.keys(tokens)[2]], 0, 1)]
    assert len(view.mapper) == 2  # type: ignore[arg-type]


def test_recomputed_keys_lora_and_salt_extra_keys() -> None:
    tokens = list(range(500, 532))
    ours = BlockHasher(16, "sha256", None)
    expected = ours.keys(tokens, lora=("sql", "/adapters/sql"), cache_salt="s1")
    mapper = RecomputedKeys(ours, {"sql": "/adapters/sql"}.get)
    event = stored([11, 12], tokens=tokens, lora_name="sql", extra_keys=[["sql", "s1"], ["sql"]])
    assert mapper.stored(event) == expected


def test_recomputed_keys_unknown_parent_raises() -> None:
    mapper = RecomputedKeys(BlockHasher(), lambda name: None)
    try:
        mapper.stored(stored([2], parent=1))
    except UnresolvableEvent:
        pass
    else:
        raise AssertionError("an unknown parent must raise")
    view = ReplicaView(mapper=mapper)
    assert view.apply_batch(0, batch(stored([2], parent=1))) == []
    assert view.stats.num_bad_events == 1


def test_block_key_of_digest_matches_event_int() -> None:
    digest = BlockHasher().digests(list(range(16)))[0]
    assert block_key(digest) == int.from_bytes(digest[-8:], "big")
