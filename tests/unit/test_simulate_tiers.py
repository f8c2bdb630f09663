"""The placement-only simulation's two-tier single cache (pure): a GPU cache backed by a host
(CPU-tier) cache, write-through, each LRU, hits as vLLM counts them (GPU run, then host run)."""

from __future__ import annotations

from loadtest.replay.simulate import LRUBlockCache, simulate_bounds, simulate_two_tier
from router.tools.trace_format import TraceRequest


def req(i: int, ids: list[int]) -> TraceRequest:
    return TraceRequest(index=i, timestamp_ms=i, input_length=len(ids) * 512 + 1, output_length=1,
                        hash_ids=tuple(ids))


def test_a_prefix_evicted_from_the_gpu_hits_in_the_host_tier() -> None:
    # GPU 2 blocks, host 6: A (2 blocks), then B (2 blocks) evicts A from the GPU; A again hits
    # both its blocks on the host tier, B's on the GPU.
    a, b = [1, 2], [3, 4]
    out = simulate_two_tier([req(0, a), req(1, b), req(2, a), req(3, b)], LRUBlockCache(2),
                            LRUBlockCache(6))
    total = 4 * (2 * 512 + 1)
    # request 2: A from the host (1,024 tokens); request 3: B evicted by A's load, host again
    assert out["cpu_token_hit_rate"] == 2048 / total
    assert out["gpu_token_hit_rate"] == 0.0
    assert out["token_hit_rate"] == 2048 / total
    # a GPU run continues on the host: [3, 4] evicts the LRU tail of [1, 2, 5] from a 3-block
    # GPU (5, then 2: freed tail first), so the GPU keeps block 1 and the host gives 2 and 5
    reqs = [req(0, [1, 2, 5]), req(1, [3, 4]), req(2, [1, 2, 5])]
    out = simulate_two_tier(reqs, LRUBlockCache(3), LRUBlockCache(8))
    total = sum(r.input_length for r in reqs)
    assert (out["gpu_token_hit_rate"], out["cpu_token_hit_rate"]) == (512 / total, 1024 / total)


def test_bounds_carry_the_two_tier_cache_only_with_a_host_capacity() -> None:
    reqs = [req(0, [1, 2]), req(1, [3, 4]), req(2, [1, 2])]
    assert "single_cache_two_tier" not in simulate_bounds(reqs, 1, 1024)
    bounds = simulate_bounds(reqs, 1, 1024, cpu_capacity_tokens_per_replica=4096)
    two = bounds["single_cache_two_tier"]
    assert bounds["single_cache"]["token_hit_rate"] == 0.0  # the GPU-only cache lost A
    assert two["token_hit_rate"] == two["cpu_token_hit_rate"] > 0.0
    assert two["token_hit_rate"] == bounds["single_cache_unlimited"]["token_hit_rate"]
