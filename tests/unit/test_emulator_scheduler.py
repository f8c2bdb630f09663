"""Unit tests of the emulator's scheduler and latency model (pure, no clock)."""

from __future__ import annotations

import pytest

from router.shared.hashing import BlockHasher
from worker.emulator.kv_cache import BlockPool, KVCacheManager
from worker.emulator.profiles import (
    GpuProfile,
    LatencyModel,
    ModelProfile,
    default_num_gpu_blocks,
)
from worker.emulator.scheduler import FinishReason, Request, Scheduler, SchedulerConfig

B = 16
HASHER = BlockHasher(B)


def make_scheduler(num_blocks: int = 2000, latency: LatencyModel | None = None,
                   budget: int = 8192, max_seqs: int = 256) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), B)

    def update(req: Request) -> None:
        have = len(req.block_hashes)
        if len(req.all_token_ids) // B > have:
            req.block_hashes.extend(HASHER.digests(
                req.all_token_ids, parent=req.block_hashes[-1] if have else None, start_block=have))

    return Scheduler(SchedulerConfig(budget, max_seqs), kv, latency or LatencyModel(), update)


def make_request(tokens: list[int], rid: str, max_out: int = 1) -> Request:
    return Request(rid, list(tokens), max_output_tokens=max_out,
                   block_hashes=HASHER.digests(tokens))


def run_until_first_token(s: Scheduler, req: Request) -> float:
    """Engine seconds from submission until ``req`` has its first token."""
    elapsed = 0.0
    while req.num_output_tokens == 0:
        step = s.schedule()
        assert step is not None
        elapsed += step.duration_s
        s.complete(step)
    return elapsed


def run_all(s: Scheduler) -> None:
    for _ in range(10000):
        if not s.has_work():
            return
        step = s.schedule()
        assert step is not None
        s.complete(step)
    raise AssertionError("scheduler did not drain")


def seed_example() -> LatencyModel:
    """The seed document's worked example: 14B, 48 layers, 40 q heads, 8 KV heads, 128 dims."""
    return LatencyModel(ModelProfile(params=14e9, num_layers=48, num_q_heads=40, num_kv_heads=8,
                                     head_dim=128), GpuProfile(tflops=400, hbm_gbps=3000))


def test_seed_arithmetic_cold_and_warm_prefill() -> None:
    lat = seed_example()
    assert lat.model.kv_bytes_per_token == 196608  # 192 KiB, as the seed computes
    cold = lat.prefill_time_s(12100)
    # Seed: ~3.4e14 linear + ~7.2e13 attention = ~4.1e14 FLOPs = ~1 s at 400 TFLOP/s.
    assert cold == pytest.approx(4.1e14 / 4e14, rel=0.05)
    warm = lat.prefill_time_s(12100, 12000)
    # Seed: ~2.8e12 linear + ~1.2e12 suffix attention = ~4e12 FLOPs = ~10 ms.
    assert warm == pytest.approx(0.010, rel=0.15)
    assert cold / warm > 50


def test_cached_prefix_makes_ttft_drop_as_predicted_through_the_scheduler() -> None:
    lat = seed_example()
    s = make_scheduler(num_blocks=5000, latency=lat)
    doc = list(range(12000))
    first = make_request([*doc, *range(50000, 50100)], "q1")
    s.add_request(first)
    ttft_cold = run_until_first_token(s, first)
    run_all(s)
    second = make_request([*doc, *range(60000, 60100)], "q2")
    s.add_request(second)
    ttft_warm = run_until_first_token(s, second)
    assert second.num_cached_tokens == 12000
    # Chunked into 8192 + 3908 tokens, the cold prefill still costs the seed's ~1 s.
    assert ttft_cold == pytest.approx(lat.prefill_time_s(12100), rel=0.02)
    assert ttft_warm == pytest.approx(lat.prefill_time_s(12100, 12000), rel=0.01)
    assert ttft_cold / ttft_warm > 50


def test_default_profiles() -> None:
    lat = LatencyModel()
    assert lat.model.kv_bytes_per_token == 131072
    assert default_num_gpu_blocks(lat.model, lat.gpu, 16) == 26702
    # 8k-token cold prefill of the default 8B model on the default GPU: ~0.37 s.
    assert lat.prefill_time_s(8192) == pytest.approx(0.372, rel=0.02)
    # A lone decode step is memory bound: 16 GB of weights at 3000 GB/s.
    assert lat.step_time_s([], 1, 1000) == pytest.approx(16e9 / 3e12, rel=0.02)


def test_chunked_prefill_respects_token_budget_and_max_num_seqs() -> None:
    s = make_scheduler(budget=1000, max_seqs=2)
    reqs = [make_request(list(range(i * 10000, i * 10000 + 1500)), f"r{i}", max_out=5)
            for i in range(3)]
    for r in reqs:
        s.add_request(r)
    step = s.schedule()
    assert step is not None
    assert [(r.request_id, n) for r, n in step.scheduled] == [("r0", 1000)]
    s.complete(step)
    step = s.schedule()
    assert step is not None
    assert [(r.request_id, n) for r, n in step.scheduled] == [("r0", 500), ("r1", 500)]
    s.complete(step)
    assert len(s.running) == 2 and len(s.waiting) == 1  # max_num_seqs holds r2 back


def test_outputs_honour_max_tokens_and_decode_bursts() -> None:
    s = make_scheduler()
    req = make_request(list(range(100)), "r", max_out=40)
    s.add_request(req)
    total = 0
    steps = 0
    while s.has_work():
        step = s.schedule()
        assert step is not None
        total += sum(o.num_new_tokens for o in s.complete(step))
        steps += 1
    assert total == 40 and req.num_output_tokens == 40
    assert req.finished is FinishReason.LENGTH
    assert steps < 40  # decode steps were applied in bursts
    # Output blocks got hashes as they filled: 140 tokens -> 8 full blocks.
    assert len(req.block_hashes) == 140 // B


def test_partial_burst_application() -> None:
    s = make_scheduler()
    req = make_request(list(range(100)), "r", max_out=50)
    s.add_request(req)
    step = s.schedule()
    assert step is not None
    s.complete(step)  # prefill -> first token
    step = s.schedule()
    assert step is not None and step.max_repeat > 3
    outs = s.complete(step, 2)
    assert outs[0].num_new_tokens == 2 and req.num_output_tokens == 3
    assert req.num_computed_tokens == req.num_tokens - 1


def test_preemption_when_decode_runs_out_of_blocks() -> None:
    # 10 usable blocks; two requests of 4 full blocks each decode into new blocks.
    s = make_scheduler(num_blocks=11)
    a = make_request(list(range(63)), "a", max_out=40)
    b = make_request(list(range(1000, 1063)), "b", max_out=40)
    s.add_request(a)
    s.add_request(b)
    run_all(s)
    assert s.num_preemptions >= 1
    assert b.num_preemptions >= 1  # the last admitted is preempted first
    assert a.num_output_tokens == 40 and b.num_output_tokens == 40
    assert s.kv.pool.num_free_blocks == 10


def test_waiting_request_admitted_only_when_blocks_free() -> None:
    s = make_scheduler(num_blocks=9)  # 8 usable blocks = 128 tokens
    a = make_request(list(range(100)), "a", max_out=2)
    b = make_request(list(range(1000, 1100)), "b", max_out=2)
    s.add_request(a)
    s.add_request(b)
    step = s.schedule()
    assert step is not None
    assert [r.request_id for r, _ in step.scheduled] == ["a"]
    assert list(s.waiting) == [b]
    run_all(s)
    assert b.finished is FinishReason.LENGTH


def test_prefix_cache_stats_count_tokens_of_new_requests() -> None:
    s = make_scheduler()
    for rid in ("a", "b"):
        s.add_request(make_request(list(range(1000)), rid))
        run_all(s)
    assert s.kv.stats.queries == 2000
    assert s.kv.stats.hits == 992


def test_decode_step_time_is_the_general_formula() -> None:
    lat = LatencyModel(step_overhead_s=0.001)
    for decodes, ctx in ((1, 0), (1, 1000), (64, 500_000), (256, 2_000_000)):
        assert lat.decode_step_time_s(decodes, ctx) == pytest.approx(
            lat.step_time_s([], decodes, ctx), rel=1e-12)


def test_a_decode_burst_takes_the_durations_of_its_steps_one_by_one() -> None:
    """A burst's planned durations are exactly (==, not approximately) what one
    ``decode_step_time_s`` call per step gives, so planning it at once moves no step's end;
    it stops at ``max_steps`` or once the burst reaches ``limit_s``."""
    for lat in (LatencyModel(), LatencyModel(step_overhead_s=0.001)):
        for decodes, ctx in ((1, 20), (3, 1000), (64, 500_000), (256, 2_000_000)):
            first = lat.decode_step_time_s(decodes, ctx)
            burst = lat.decode_burst_durations_s(decodes, ctx, first, 40, 1.0)
            one_by_one = [first]
            while len(one_by_one) < 40 and sum(one_by_one) < 1.0:
                one_by_one.append(lat.decode_step_time_s(decodes,
                                                         ctx + len(one_by_one) * decodes))
            assert burst == one_by_one and len(burst) > 1
    lat = LatencyModel()
    first = lat.decode_step_time_s(8, 8000)
    assert lat.decode_burst_durations_s(8, 8000, first, 5, 10.0) == [
        first, *(lat.decode_step_time_s(8, 8000 + k * 8) for k in range(1, 5))]
    assert lat.decode_burst_durations_s(8, 8000, first, 100, first) == [first]
