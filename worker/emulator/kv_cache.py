"""Paged KV block pool and prefix-cache manager with vLLM 0.33 semantics. Pure: no I/O.

Modelled on vLLM v1 ``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py``
(single KV-cache group, full attention):

* ``num_gpu_blocks`` physical blocks; block 0 is the reserved *null block*
  (vLLM's ``BlockPool`` takes it at start-up), so ``num_gpu_blocks - 1`` are usable;
* only full blocks carry a hash; the lookup table maps a block hash to the
  physical blocks holding it (several may: a request that computed a block while
  another computed the same hash keeps its own copy; ``BlockHashToBlockMap``);
* a new request walks its block hashes from block 0 and reuses the longest run of
  cached blocks, capped at ``floor((N - 1) / B)`` blocks (the last prompt token is
  always recomputed, ``get_computed_blocks``);
* blocks are reference-counted; a cached block whose count drops to 0 joins the
  tail of the LRU free queue *still cached*, a block without a hash (a partial
  last block, or any block with prefix caching off) its head, to be reused first
  (``free_blocks``); a request's blocks are freed tail-first (``free`` walks them
  reversed), so shared heads are evicted last;
* taking a block from the head of the free queue whose hash is cached evicts
  that hash (``BlockRemoved``, ``_maybe_evict_cached_block``); reviving a cached
  free block on a hit pulls it out of the queue (``touch``);
* newly full blocks, prompt or output, are committed to the cache when the step
  that computes them is scheduled (``cache_full_blocks``: one ``BlockStored`` per
  run of consecutive new full blocks of one request);
* ``reset_prefix_cache`` succeeds only when no block is in use and then drops
  every hash (``AllBlocksCleared``).

Events are queued as plain objects (raw digests) and taken by the caller, which
publishes them elsewhere.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One physical block. ``ref_cnt`` >= 0; ``block_hash`` is the raw digest while cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Event: consecutive full blocks of one request committed to the cache.

    ``block_hashes`` raw digests; ``parent_block_hash`` the digest of the block
    before the first, None when the run starts at block 0; ``token_ids`` the
    tokens of those blocks; ``extra_keys`` one entry per block (None or the
    untagged extra-key values, vLLM ``to_event_extra_keys``).
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[list[Any] | None]


@dataclass(slots=True)  # not frozen: one per evicted block, and frozen init costs twice as much
class BlockEvicted:
    """Event: a cached block's physical block was reallocated (one per hash)."""

    block_hash: bytes


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """Event: the prefix cache was reset."""


KVEvent = BlocksStored | BlockEvicted | CacheCleared


class CacheRequest(Protocol):
    """What the cache manager needs from a request (the scheduler's ``Request``)."""

    request_id: str
    all_token_ids: list[int]
    block_hashes: list[bytes]
    num_computed_tokens: int
    lora_id: int | None
    lora_name: str | None
    cache_salt: str | None
    blocks: list[KVCacheBlock]
    num_cached_blocks: int

    @property
    def num_tokens(self) -> int: ...


class BlockPool:
    """The physical blocks, the free queue and the hash table (vLLM ``BlockPool``).

    Invariants: a block is in the free queue iff ``ref_cnt == 0`` (the null block
    never is); every hashed block is in ``_hash_to_blocks`` under its hash.
    """

    def __init__(self, num_gpu_blocks: int, *, enable_kv_cache_events: bool = True) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        # {block_id: block}, insertion order = LRU order, head = next victim
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:]
        )
        # {block_hash: block, or {block_id: block} when several physical blocks hold that hash}:
        # as vLLM 0.33's BlockHashToBlockMap, a dict per hash only for the rare duplicates.
        self._hash_to_blocks: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        self.enable_kv_cache_events = enable_kv_cache_events
        self._events: list[KVEvent] = []

    @property
    def num_usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ``ref_cnt == 0`` (cached or empty): what admission may use."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, 0..1 (vLLM ``get_usage``, ``kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / self.num_usable_blocks

    @property
    def num_cached_hashes(self) -> int:
        return len(self._hash_to_blocks)

    def free_queue_ids(self) -> list[int]:
        """Block ids in eviction order (head first); for tests and debugging."""
        return list(self._free)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """Any physical block holding ``block_hash``, or None."""
        held = self._hash_to_blocks.get(block_hash)
        if isinstance(held, dict):
            return next(iter(held.values()))
        return held

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._hash_to_blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on hit blocks, reviving free-but-cached ones from the queue."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting their hashes.

        Raises ``ValueError`` if fewer are free (callers check first).
        """
        if num_blocks > len(self._free):
            raise ValueError(f"cannot get {num_blocks} free blocks, only {len(self._free)} free")
        out: list[KVCacheBlock] = []
        popitem = self._free.popitem
        for _ in range(num_blocks):
            _, block = popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        table = self._hash_to_blocks
        held = table[block_hash]
        if held is block:
            del table[block_hash]
        else:
            assert isinstance(held, dict)
            del held[block.block_id]
            if len(held) == 1:
                table[block_hash] = next(iter(held.values()))
        block.block_hash = None
        if self.enable_kv_cache_events:
            self._events.append(BlockEvicted(block_hash))

    def cache_full_blocks(
        self, request: CacheRequest, num_full_blocks: int, block_size: int
    ) -> None:
        """Commit ``request.blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        Emits one ``BlocksStored`` for the run (vLLM ``BlockPool.cache_full_blocks``).
        Requires ``len(request.block_hashes) >= num_full_blocks``.
        """
        start = request.num_cached_blocks
        if start >= num_full_blocks:
            return
        hashes = request.block_hashes[start:num_full_blocks]
        table = self._hash_to_blocks
        for block, block_hash in zip(request.blocks[start:num_full_blocks], hashes, strict=True):
            block.block_hash = block_hash
            held = table.setdefault(block_hash, block)
            if held is not block:  # a duplicate hash (vLLM may store one hash twice)
                if isinstance(held, dict):
                    held[block.block_id] = block
                else:
                    table[block_hash] = {held.block_id: held, block.block_id: block}
        request.num_cached_blocks = num_full_blocks
        if self.enable_kv_cache_events:
            extra = event_extra_keys(request.lora_name, request.cache_salt, start, num_full_blocks)
            self._events.append(BlocksStored(
                block_hashes=hashes,
                parent_block_hash=request.block_hashes[start - 1] if start else None,
                token_ids=request.all_token_ids[start * block_size : num_full_blocks * block_size],
                block_size=block_size,
                lora_id=request.lora_id,
                lora_name=request.lora_name,
                extra_keys=extra,
            ))

    def free_blocks(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference per block (``ordered_blocks`` in eviction priority, first evicted
        first). Of the blocks reaching 0, those without a hash go to the head of the free queue,
        keeping their order, and cached ones to its tail (vLLM 0.32/0.33
        ``BlockPool.free_blocks``: LIFO reuse of blocks that can never hit, so a request's
        partial last block is reused before any cached block is evicted)."""
        free = self._free
        uncached: list[KVCacheBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    uncached.append(block)
                else:
                    free[block.block_id] = block
        for block in reversed(uncached):  # prepend_n: the first of them ends up at the head
            free[block.block_id] = block
            free.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash if no block is in use; return whether it did (vLLM semantics)."""
        if len(self._free) != self.num_usable_blocks:
            return False
        for held in self._hash_to_blocks.values():
            for block in (held.values() if isinstance(held, dict) else (held,)):
                block.block_hash = None
        self._hash_to_blocks.clear()
        if self.enable_kv_cache_events:
            self._events.append(CacheCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


def event_extra_keys(
    lora_name: str | None, cache_salt: str | None, start_block: int, end_block: int
) -> list[list[Any] | None]:
    """Untagged extra keys per block as events carry them (vLLM ``to_event_extra_keys``):
    the bare LoRA name on every block, the bare cache_salt on block 0."""
    if lora_name is None and (not cache_salt or start_block > 0):
        return [None] * (end_block - start_block)  # the common case, without a loop
    out: list[list[Any] | None] = []
    for index in range(start_block, end_block):
        keys: list[Any] = []
        if lora_name is not None:
            keys.append(lora_name)
        if cache_salt and index == 0:
            keys.append(cache_salt)
        out.append(keys or None)
    return out


@dataclass(slots=True)
class PrefixCacheStats:
    """Token counters of prefix-cache lookups by new (non-preempted) requests."""

    queries: int = 0
    hits: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass(slots=True)
class KVCacheManager:
    """Per-request block tables over a ``BlockPool`` (vLLM ``KVCacheManager``, one group)."""

    pool: BlockPool
    block_size: int
    enable_caching: bool = True
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached blocks from block 0, capped at ``floor((N-1)/B)`` blocks.

        Returns ``(blocks, num_hit_tokens)``; takes no references (``allocate_slots`` does).
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        table = self.pool._hash_to_blocks
        for block_hash in request.block_hashes[:max_blocks]:
            held = table.get(block_hash)
            if held is None:
                break
            hits.append(next(iter(held.values())) if isinstance(held, dict) else held)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if not self.enable_caching:
            return  # vLLM looks nothing up (and counts no queries) with prefix caching off
        if preempted:
            self.stats.preempted_queries += num_tokens
            self.stats.preempted_hits += num_hits
        else:
            self.stats.queries += num_tokens
            self.stats.hits += num_hits

    def allocate_slots(
        self,
        request: CacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        *,
        cache: bool = True,
        full_sequence_must_fit: bool = False,
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens after its computed ones
        (plus the hit blocks ``new_computed_blocks``), then commit newly full blocks.

        Returns False, changing nothing, when too few blocks are free (vLLM
        ``allocate_slots`` returning None). Hit blocks that sit in the free queue
        count against the free blocks too (they leave the queue). ``cache=False`` commits
        nothing (vLLM ``delay_cache_blocks``: blocks a CPU-tier load is still filling).
        ``full_sequence_must_fit``: also return False unless blocks for all of the request's
        tokens are free, not only for this chunk's (vLLM 0.32/0.33 ``allocate_slots``
        ``full_sequence_must_fit``, which the scheduler sets when admitting a waiting request:
        ``SchedulerConfig.scheduler_reserve_full_isl``, on by default).
        """
        if not new_computed_blocks and (request.num_computed_tokens + num_new_tokens
                                        < self.next_work_total(request)):
            # The common decode case: the tokens fit the blocks the request has and fill no
            # block that is not committed yet: nothing to allocate or commit.
            return True
        pool = self.pool
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_required = -(-total // self.block_size)
        num_new_blocks = num_required - len(request.blocks) - len(new_computed_blocks)
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        num_free = pool.num_free_blocks
        if full_sequence_must_fit:
            num_full_new = (-(-request.num_tokens // self.block_size) - len(request.blocks)
                            - len(new_computed_blocks))
            if max(num_full_new, 0) + num_evictable_hits > num_free:
                return False
        if max(num_new_blocks, 0) + num_evictable_hits > num_free:
            return False
        if new_computed_blocks:
            pool.touch(new_computed_blocks)
            request.blocks.extend(new_computed_blocks)
            request.num_cached_blocks = len(request.blocks)
        if num_new_blocks > 0:
            request.blocks.extend(pool.get_new_blocks(num_new_blocks))
        if self.enable_caching and cache:
            num_full = min(total, request.num_tokens) // self.block_size
            pool.cache_full_blocks(request, num_full, self.block_size)
        return True

    def next_work_total(self, request: CacheRequest) -> int:
        """The smallest token total (computed plus new tokens) for which ``allocate_slots``
        without hit blocks has work to do for ``request`` as it stands: a block to take (the
        first token past its blocks) or a full block to commit (the token that fills the block
        after its committed ones). Below it the call returns True at once and changes nothing;
        from it on it takes the full path (a decode burst calls it only there)."""
        size = self.block_size
        total = len(request.blocks) * size + 1
        if self.enable_caching:
            commit = (request.num_cached_blocks + 1) * size
            if commit <= request.num_tokens and commit < total:
                total = commit
        return total

    def free(self, request: CacheRequest) -> None:
        """Release a finished or preempted request's blocks, tail first."""
        self.pool.free_blocks(request.blocks[::-1])
        request.blocks = []
        request.num_cached_blocks = 0

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
