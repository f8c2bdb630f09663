"""Unit tests of the emulator's CPU tier (vLLM native KV offloading) through the scheduler."""

from __future__ import annotations

import msgspec
import pytest

from router.shared.hashing import BlockHasher, block_key
from router.shared.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from worker.emulator.kv_cache import BlockEvicted, BlockPool, BlocksStored, KVCacheManager
from worker.emulator.offload import CpuOffload, OffloadRemoved, OffloadStored, num_cpu_blocks
from worker.emulator.profiles import LatencyModel, ModelProfile
from worker.emulator.publisher import to_wire_events
from worker.emulator.scheduler import Request, Scheduler, SchedulerConfig

B = 16
HASHER = BlockHasher(B)
BLOCK_BYTES = ModelProfile().kv_bytes_per_token * B  # 2 MiB: 8B-class model, bf16
LINK = 50e9  # bytes/s


def make(num_gpu_blocks: int = 200, num_cpu_blocks: int = 100) -> tuple[Scheduler, CpuOffload]:
    kv = KVCacheManager(BlockPool(num_gpu_blocks), B)
    offload = CpuOffload(num_cpu_blocks, B, BLOCK_BYTES, LINK)

    def update(req: Request) -> None:
        have = len(req.block_hashes)
        if len(req.all_token_ids) // B > have:
            req.block_hashes.extend(HASHER.digests(
                req.all_token_ids, parent=req.block_hashes[-1] if have else None, start_block=have))

    return Scheduler(SchedulerConfig(), kv, LatencyModel(), update, offload), offload


def request(tokens: list[int], rid: str) -> Request:
    return Request(rid, list(tokens), max_output_tokens=1, block_hashes=HASHER.digests(tokens))


def step(s: Scheduler, offload: CpuOffload, now: float) -> float:
    """One engine iteration as the app runs it: a step, or a wait for the next transfer."""
    planned = s.schedule(now)
    if planned is None:
        done = offload.next_done_s()
        assert done is not None
        return max(now, done)
    s.complete(planned)
    return now + planned.duration_s


def run(s: Scheduler, offload: CpuOffload, now: float = 0.0) -> float:
    """Run to idle, waiting for CPU-tier transfers the way the app does; return the end time."""
    for _ in range(10000):
        if s.has_work():
            now = step(s, offload, now)
            continue
        done = offload.next_done_s()
        if done is None:
            return now
        now = max(now, done)
        offload.advance(now)
    raise AssertionError("did not drain")


def ttft(s: Scheduler, offload: CpuOffload, req: Request, now: float) -> float:
    s.add_request(req)
    start = now
    while req.num_output_tokens == 0:
        now = step(s, offload, now)
    return now - start


def test_write_through_store_visible_when_the_copy_ends() -> None:
    s, offload = make()
    req = request(list(range(64)), "a")
    s.add_request(req)
    step = s.schedule(0.0)
    assert step is not None
    # Stored as the step makes the blocks full, not when the GPU evicts them: copy in flight.
    assert offload.num_cached_blocks == 4
    assert not any(offload.is_ready(h) for h in req.block_hashes)
    copy_s = 4 * BLOCK_BYTES / LINK
    end = step.duration_s + copy_s  # the copy starts when the next step does
    assert offload.next_done_s() == pytest.approx(end)
    s.complete(step)
    assert offload.advance(end - 1e-6) == [] and offload.take_events() == []
    offload.advance(end)
    assert all(offload.is_ready(h) for h in req.block_hashes)
    assert offload.take_events() == [OffloadStored(req.block_hashes[:4])]
    assert offload.stats.store_bytes == 4 * BLOCK_BYTES
    assert offload.stats.store_s == pytest.approx(copy_s)


def test_lru_eviction_takes_tail_blocks_of_the_least_recent_request_first() -> None:
    s, offload = make(num_cpu_blocks=6)
    a = request(list(range(64)), "a")
    b = request(list(range(1000, 1064)), "b")
    s.add_request(a)
    run(s, offload)
    offload.take_events()
    s.add_request(b)
    run(s, offload)
    # Six host blocks: b's four need two of a's; a's tail blocks go first (touch walks reversed).
    removed, stored = offload.take_events()
    assert removed == OffloadRemoved([a.block_hashes[3], a.block_hashes[2]])
    assert stored == OffloadStored(b.block_hashes[:4])
    assert offload.lru_order() == [a.block_hashes[1], a.block_hashes[0], *b.block_hashes[3::-1]]


def test_gpu_miss_cpu_hit_loads_and_counts_as_vllm_does() -> None:
    # GPU pool of 5 usable blocks: b evicts a from the GPU; the host tier still holds a.
    s, offload = make(num_gpu_blocks=6)
    tokens = list(range(64))
    a = request(tokens, "a")
    s.add_request(a)
    now = run(s, offload)
    s.add_request(request(list(range(1000, 1080)), "b"))
    now = run(s, offload, now)
    assert not any(s.kv.pool.is_cached(h) for h in a.block_hashes)
    s.kv.pool.take_events()
    queries, hits = s.kv.stats.queries, s.kv.stats.hits
    again = request(tokens, "c")
    s.add_request(again)
    assert s.schedule(now) is None  # loading: nothing else to run
    assert s.has_work()
    load_s = 4 * BLOCK_BYTES / LINK
    assert offload.next_done_s() == pytest.approx(now + load_s)
    elapsed = ttft(s, offload, again, now)
    # All four blocks came from the host; the last token is recomputed (64 -> 63 cached).
    assert again.num_cached_tokens == 63
    assert s.kv.stats.queries - queries == 64 and s.kv.stats.hits - hits == 0
    assert offload.stats.external_queries == 64 + 80 + 64 and offload.stats.external_hits == 64
    assert offload.stats.load_bytes == 4 * BLOCK_BYTES
    # The loaded blocks are committed to the GPU prefix cache when the load ends.
    stored = [e for e in s.kv.pool.take_events() if isinstance(e, BlocksStored)]
    assert stored[0].block_hashes == again.block_hashes[:4]
    # TTFT: the transfer plus a one-token step (a 64-token prompt is weight-read bound, so
    # here the load costs more than recomputing would; long prompts: next test).
    assert elapsed == pytest.approx(load_s + LatencyModel().prefill_time_s(64, 63))


def test_long_prompt_from_the_cpu_tier_much_faster_than_recompute() -> None:
    s, offload = make(num_gpu_blocks=300, num_cpu_blocks=1000)
    tokens = list(range(4096))  # 256 blocks
    s.add_request(request(tokens, "a"))
    now = run(s, offload)
    assert s.kv.reset_prefix_cache()  # the GPU forgets; the host tier keeps all 256 blocks
    elapsed = ttft(s, offload, request([*tokens, 5], "c"), now)
    load_s = 256 * BLOCK_BYTES / LINK  # 10.7 ms over 50 GB/s
    assert elapsed == pytest.approx(load_s + LatencyModel().prefill_time_s(4097, 4096))
    assert elapsed < LatencyModel().prefill_time_s(4097, 0) / 5  # recompute: ~170 ms


def test_partial_gpu_hit_then_cpu_blocks_after_it() -> None:
    s, offload = make(num_gpu_blocks=8)
    a = request(list(range(96)), "a")  # 6 blocks
    s.add_request(a)
    now = run(s, offload)
    # Evict a's tail from the GPU (tail-first), keeping its head: 7 usable blocks.
    s.add_request(request(list(range(2000, 2064)), "x"))
    now = run(s, offload, now)
    gpu_hit = sum(1 for h in a.block_hashes if s.kv.pool.is_cached(h))
    assert 0 < gpu_hit < 6
    again = request(list(range(96)) + [7] * 8, "b")
    ttft(s, offload, again, now)
    assert again.num_cached_tokens == 96  # gpu_hit blocks from the GPU, the rest loaded
    assert offload.stats.external_hits == (6 - gpu_hit) * B


def test_lookup_deferred_while_its_blocks_load_for_another_request() -> None:
    s, offload = make(num_gpu_blocks=10)
    tokens = list(range(64))
    s.add_request(request(tokens, "a"))
    now = run(s, offload)
    s.kv.pool.reset_prefix_cache()
    first, second = request([*tokens, 1], "b"), request([*tokens, 2], "c")
    other = request(list(range(5000, 5032)), "d")
    for r in (first, second, other):
        s.add_request(r)
    # The second waits for the first's load; the one behind it is not held up (vLLM skips).
    step = s.schedule(now)
    assert step is not None and [r for r, _ in step.scheduled] == [other]
    assert offload.has_pending_loads() and list(s.waiting) == [second]
    s.complete(step)
    done = offload.next_done_s()
    assert done is not None
    # After the load the second request hits the blocks on the GPU instead of loading again.
    step = s.schedule(max(done, now + step.duration_s))
    assert step is not None
    assert second.num_cached_tokens == 64 and first.num_cached_tokens == 64
    assert offload.stats.load_bytes == 4 * BLOCK_BYTES


def test_store_skipped_when_every_host_block_is_pinned_by_loads() -> None:
    offload = CpuOffload(2, B, BLOCK_BYTES, LINK)
    a = request(list(range(32)), "a")
    a.num_computed_tokens = 0
    offload.store([(a, 32)], 0.0)
    offload.advance(1.0)
    offload.take_events()
    loader = request(list(range(32)), "l")
    offload.start_load(loader, 0, 2, 1.0)
    b = request(list(range(500, 532)), "b")
    offload.store([(b, 32)], 1.0)
    assert b.num_offloaded_blocks == 0 and offload.take_events() == []  # retried next step
    offload.advance(2.0)
    offload.store([(b, 32)], 2.0)
    assert b.num_offloaded_blocks == 2
    assert offload.take_events() == [OffloadRemoved([a.block_hashes[1], a.block_hashes[0]])]


def test_cpu_events_on_the_wire_as_vllm_publishes_them() -> None:
    digests = HASHER.digests(list(range(32)))
    wire = to_wire_events([OffloadStored(digests), OffloadRemoved(digests[:1]),
                           BlockEvicted(digests[0])], int_block_hashes=True, block_size=B)
    payload = encode_batch(KVEventBatch(ts=1.0, events=wire, data_parallel_rank=0))
    raw = msgspec.msgpack.decode(payload)
    # Connector events: no parent, no tokens, no LoRA, no group (omitted), medium "CPU".
    assert raw[1][0] == {"type": "BlockStored", "block_hashes": [block_key(d) for d in digests],
                         "parent_block_hash": None, "token_ids": [], "block_size": B,
                         "lora_id": None, "medium": "CPU", "lora_name": None}
    assert raw[1][1] == {"type": "BlockRemoved", "block_hashes": [block_key(digests[0])],
                         "medium": "CPU"}
    batch = decode_batch(payload)
    assert isinstance(batch.events[0], BlockStored) and batch.events[0].medium == "CPU"
    assert isinstance(batch.events[2], BlockRemoved) and batch.events[2].medium == "GPU"


def test_tier_off_scheduler_has_no_offload_and_sizes() -> None:
    kv = KVCacheManager(BlockPool(50), B)
    s = Scheduler(SchedulerConfig(), kv, LatencyModel(), lambda r: None)
    assert s.offload is None
    s.add_request(request(list(range(40)), "a"))
    assert s.schedule() is not None
    # vLLM: size GiB * 2**30 bytes over the bytes of one block (2 MiB here).
    assert num_cpu_blocks(4.0, BLOCK_BYTES) == 2048
    with pytest.raises(ValueError):
        CpuOffload(0, B, BLOCK_BYTES, LINK)
