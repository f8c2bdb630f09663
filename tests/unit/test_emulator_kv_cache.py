"""Unit tests of the emulator's block pool and cache manager (vLLM prefix-caching rules)."""

from __future__ import annotations

from router.shared.hashing import BlockHasher
from worker.emulator.kv_cache import (
    BlockEvicted,
    BlockPool,
    BlocksStored,
    CacheCleared,
    KVCacheManager,
)
from worker.emulator.scheduler import Request

B = 16
HASHER = BlockHasher(B)


def make_request(tokens: list[int], rid: str = "r", salt: str | None = None) -> Request:
    return Request(rid, list(tokens), max_output_tokens=1, cache_salt=salt,
                   block_hashes=HASHER.digests(tokens, cache_salt=salt))


def admit(kv: KVCacheManager, req: Request) -> int:
    """Admit a whole prompt like the scheduler does; return hit tokens."""
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    req.num_computed_tokens = num_hit
    return num_hit


def test_full_block_rule_1000_and_992_tokens() -> None:
    kv = KVCacheManager(BlockPool(1000), B)
    first = make_request(list(range(1000)), "a")
    assert admit(kv, first) == 0
    second = make_request(list(range(1000)), "b")
    assert admit(kv, second) == 992  # floor(999/16) = 62 blocks, hit while the first still runs
    kv.free(first)
    kv.free(second)
    exact = make_request(list(range(5000, 5992)), "c")
    assert admit(kv, exact) == 0
    kv.free(exact)
    again = make_request(list(range(5000, 5992)), "d")
    assert admit(kv, again) == 976  # floor(991/16) = 61 blocks: the last token is recomputed


def test_only_full_blocks_are_stored_and_events_chain() -> None:
    pool = BlockPool(100)
    kv = KVCacheManager(pool, B)
    req = make_request(list(range(40)), "a")
    admit(kv, req)
    events = pool.take_events()
    assert len(events) == 1 and isinstance(events[0], BlocksStored)
    stored = events[0]
    assert stored.block_hashes == req.block_hashes[:2]
    assert stored.parent_block_hash is None
    assert stored.token_ids == list(range(32))
    assert stored.extra_keys == [None, None]
    # A second request hitting block 0 and extending stores from block 1 with parent = block 0.
    other = make_request([*range(16), *range(100, 133)], "b")
    assert admit(kv, other) == 16
    (ev,) = pool.take_events()
    assert isinstance(ev, BlocksStored)
    assert ev.parent_block_hash == req.block_hashes[0]
    assert ev.block_hashes == other.block_hashes[1:3]


def test_cache_salt_extra_keys_on_block_zero_only() -> None:
    pool = BlockPool(10)
    kv = KVCacheManager(pool, B)
    admit(kv, make_request(list(range(40)), salt="tenant"))
    (ev,) = pool.take_events()
    assert isinstance(ev, BlocksStored)
    assert ev.extra_keys == [["tenant"], None]


def test_free_is_tail_first_and_eviction_takes_tails_before_shared_heads() -> None:
    # 1 null block + 8 usable blocks.
    pool = BlockPool(9)
    kv = KVCacheManager(pool, B)
    shared = list(range(32))  # 2 shared head blocks
    a = make_request([*shared, *range(1000, 1033)], "a")  # 5 blocks: 2 shared + 2 own + partial
    admit(kv, a)
    head_ids = [b.block_id for b in a.blocks[:2]]
    kv.free(a)
    # Free queue: empty blocks first, then a's blocks tail first.
    queue = pool.free_queue_ids()
    assert queue[-2:] == head_ids[::-1]
    pool.take_events()
    # A distinct prompt needing 6 blocks takes the 3 empty ones, then a's tail first:
    # its partial block (no hash), then blocks 3 and 2 (evicted); the shared head stays.
    b = make_request(list(range(2000, 2081)), "b")
    admit(kv, b)
    evicted = [e.block_hash for e in pool.take_events() if isinstance(e, BlockEvicted)]
    assert evicted == [a.block_hashes[3], a.block_hashes[2]]
    assert pool.is_cached(a.block_hashes[0]) and pool.is_cached(a.block_hashes[1])
    kv.free(b)
    # The shared head is still a hit.
    c = make_request([*shared, *range(3000, 3017)], "c")
    assert admit(kv, c) == 32


def test_hit_revives_free_block_and_ref_counts() -> None:
    pool = BlockPool(20)
    kv = KVCacheManager(pool, B)
    a = make_request(list(range(48)), "a")
    admit(kv, a)
    kv.free(a)
    free_before = pool.num_free_blocks
    b = make_request(list(range(48)), "b")
    assert admit(kv, b) == 32
    assert [blk.ref_cnt for blk in b.blocks] == [1, 1, 1]
    assert pool.num_free_blocks == free_before - 3
    c = make_request(list(range(48)), "c")
    admit(kv, c)
    assert b.blocks[0].ref_cnt == 2


def test_duplicate_hashes_in_two_physical_blocks() -> None:
    pool = BlockPool(40)
    kv = KVCacheManager(pool, B)
    a = make_request(list(range(64)), "a")
    b = make_request(list(range(64)), "b")
    # Both looked up before either committed (same scheduler step in vLLM can do this
    # when a chunked prefill is in flight); model it by computing hits first.
    hits_a, _ = kv.get_computed_blocks(a)
    hits_b, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(a, 64, hits_a)
    assert kv.allocate_slots(b, 64, hits_b)
    stored = [e for e in pool.take_events() if isinstance(e, BlocksStored)]
    assert len(stored) == 2 and stored[0].block_hashes == stored[1].block_hashes
    assert {blk.block_id for blk in a.blocks}.isdisjoint({blk.block_id for blk in b.blocks})


def test_allocation_fails_without_free_blocks_and_changes_nothing() -> None:
    pool = BlockPool(5)  # 4 usable
    kv = KVCacheManager(pool, B)
    a = make_request(list(range(64)), "a")
    admit(kv, a)
    b = make_request(list(range(100, 120)), "b")
    assert not kv.allocate_slots(b, 20)
    assert b.blocks == [] and pool.num_free_blocks == 0


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(10)
    kv = KVCacheManager(pool, B)
    a = make_request(list(range(40)), "a")
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    pool.take_events()
    assert kv.reset_prefix_cache()
    assert pool.take_events() == [CacheCleared()]
    assert pool.num_cached_hashes == 0
    assert pool.usage == 0.0
