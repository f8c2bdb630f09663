"""Tier-aware hit depths and their valuation (pure): the index continues a replica's GPU hit with
its CPU tier as vLLM looks blocks up, and both index policies value a CPU-tier hit by what it
saves (the host-to-GPU transfer instead of the prefill), neither as a GPU hit nor as nothing."""

from __future__ import annotations

import pytest

from router.decision.index import BlockIndex
from router.decision.policy import Candidate, PolicyParams, RouteInput, decide
from router.decision.ring import HashRing
from router.decision.ttft import (
    DEFAULT_CPU_LOAD_TOKENS_PER_S,
    DEFAULT_PRIOR_TOKENS_PER_S,
    cpu_hit_value,
)
from router.shared.contract import TIER_CPU

IDS = ("replica-0", "replica-1", "replica-2")
RING = HashRing(IDS, vnodes=64)
CHAIN = list(range(5000, 5032))  # 32 blocks
NUM_TOKENS = 32 * 16 + 8
PARAMS = PolicyParams(block_size=16)
REPLICAS = [Candidate(rid) for rid in IDS]


def test_cpu_hit_value_is_the_share_of_the_prefill_saved() -> None:
    # 8B model: 25k prefill tokens/s, 381k tokens/s over a 50 GB/s host link (128 KiB per token)
    assert DEFAULT_CPU_LOAD_TOKENS_PER_S == pytest.approx(381_470, rel=1e-4)
    assert cpu_hit_value(DEFAULT_PRIOR_TOKENS_PER_S, DEFAULT_CPU_LOAD_TOKENS_PER_S) == \
        pytest.approx(1 - 25_000 / 381_470, rel=1e-4)
    assert cpu_hit_value(1000.0, 4000.0) == 0.75
    assert cpu_hit_value(5000.0, 4000.0) == 0.0  # a link slower than the prefill saves nothing
    with pytest.raises(ValueError):
        cpu_hit_value(1000.0, 0.0)


def test_tier_depths_continue_the_gpu_hit_with_the_host_tier_only_consecutively() -> None:
    index = BlockIndex()
    index.add("replica-0", CHAIN[:3])  # GPU: blocks 0-2
    index.add("replica-0", CHAIN[2:6], TIER_CPU)  # host: blocks 2-5 -> loaded 3-5
    index.add("replica-1", CHAIN[:10], TIER_CPU)  # host only: blocks 0-9
    index.add("replica-2", CHAIN[:1])  # GPU: block 0; host: block 2 but not 1 -> no load
    index.add("replica-2", CHAIN[2:3], TIER_CPU)
    _, combined = index.hit_depths(CHAIN, index.mask_of(IDS))
    assert combined == {"replica-0": 3, "replica-1": 0, "replica-2": 1}
    assert index.tier_depths(CHAIN, combined) == {"replica-0": 6, "replica-1": 10, "replica-2": 1}
    assert index.num_blocks("replica-1", TIER_CPU) == 10 and index.num_blocks("replica-1") == 0
    # clearing a replica forgets both tiers (one slot), and the sweep frees it from both tables
    index.clear("replica-1")
    assert index.tier_depths(CHAIN, combined)["replica-1"] == 0
    index.sweep_all()
    assert index.num_cpu_keys == 4  # replica-0's blocks 2-5 (replica-2's block 2 is one of them)


def test_tier_depths_on_the_coarse_index_walk_anchors() -> None:
    index = BlockIndex(stride=4)  # anchors at depths 0, 1, 3, 7, 11, ...
    index.add("replica-0", [CHAIN[0], CHAIN[1]])  # GPU hit: 2 blocks
    index.add("replica-0", [CHAIN[3], CHAIN[7]], TIER_CPU)  # host: through anchor 7 -> 8
    _, combined = index.hit_depths(CHAIN, index.mask_of(IDS))
    assert combined["replica-0"] == 2
    assert index.tier_depths(CHAIN, combined)["replica-0"] == 8


def route(policy: str, gpu: dict[str, int], total: dict[str, int],
          params: PolicyParams = PARAMS) -> tuple[str, dict[str, dict[str, float]]]:
    d = decide(policy, RouteInput(CHAIN, NUM_TOKENS, CHAIN[0]), REPLICAS, RING,
               confirmed=gpu, combined=gpu, tiered=total, params=params)
    return d.replica_id, d.details


@pytest.mark.parametrize("policy", ["prefix", "ttft"])
def test_a_cpu_tier_hit_is_worth_less_than_a_gpu_hit_and_more_than_nothing(policy: str) -> None:
    # replica-0 holds 24 blocks on the GPU, replica-1 the same 24 only on its host tier
    chosen, details = route(policy, {"replica-0": 24}, {"replica-0": 24, "replica-1": 24})
    assert chosen == "replica-0"
    assert details["replica-1"]["cpu_hit_blocks"] == 24
    assert details["replica-1"]["hit_blocks"] == 0
    # ... against a GPU hit of 16: the host tier's 24 save more than the GPU's 16
    chosen, details = route(policy, {"replica-0": 16}, {"replica-0": 16, "replica-1": 24})
    assert chosen == "replica-1", details
    # ... with a host link as slow as the prefill, the host tier's hit saves nothing
    slow = PolicyParams(block_size=16, cpu_load_tokens_per_s=DEFAULT_PRIOR_TOKENS_PER_S)
    chosen, _ = route(policy, {"replica-0": 16}, {"replica-0": 16, "replica-1": 24}, slow)
    assert chosen == "replica-0"


def test_ttft_counts_the_transfer_in_the_prefill() -> None:
    _, details = route("ttft", {"replica-0": 24}, {"replica-0": 24, "replica-1": 24})
    gpu, cpu, cold = (details[r] for r in IDS)
    assert cpu["load_s"] == pytest.approx(24 * 16 / DEFAULT_CPU_LOAD_TOKENS_PER_S)
    assert gpu["load_s"] == cold["load_s"] == 0.0
    # the same tokens left to prefill on both; the CPU-tier replica pays their transfer
    assert cpu["prefill_s"] == pytest.approx(gpu["prefill_s"] + cpu["load_s"])
    assert gpu["prefill_s"] < cpu["prefill_s"] < cold["prefill_s"]


def test_the_hit_cap_covers_both_tiers() -> None:
    # vLLM never hits the last prompt token: floor((N - 1) / B) blocks in all, GPU + CPU
    d = decide("prefix", RouteInput(CHAIN, 32 * 16, CHAIN[0]), REPLICAS, RING,
               confirmed={"replica-0": 20}, combined={"replica-0": 20},
               tiered={"replica-0": 32}, params=PARAMS)
    assert d.hit("replica-0").blocks == 20 and d.hit("replica-0").cpu_blocks == 11
    assert d.hit("replica-0").total_blocks == 31 and d.predicted_hit


def test_fleet_applies_entries_per_tier_and_a_cleared_entry_resets_every_tier() -> None:
    from router.decision.fleet import Fleet
    from router.service.config import load_config
    from router.shared import contract as c
    from router.shared.hashing import BlockHasher

    fleet = Fleet(load_config(["--redis-url", "redis://127.0.0.1:1/0", "--index-stride", "1"],
                              env={}), BlockHasher(16, "sha256"))
    fleet.apply_heartbeat("r", {c.F_URL: "http://127.0.0.1:1", c.F_CONTRACT: "4",
                                c.F_KV_TIERS: "GPU,CPU"}, 0.0)
    assert fleet.replicas["r"].kv_tiers == ("GPU", "CPU")
    assert fleet.apply_changes("r", 0, False, [1, 2], [], cpu_stored=[1, 2, 3]) is None
    assert fleet.apply_changes("r", 0, False, [], [2], cpu_removed=[1]) is None
    index = fleet.index
    assert (index.num_blocks("r"), index.num_blocks("r", c.TIER_CPU)) == (1, 2)
    _, combined = index.hit_depths([1, 2, 3], index.mask_of(["r"]))
    assert combined == {"r": 1} and index.tier_depths([1, 2, 3], combined) == {"r": 3}
    assert fleet.apply_changes("r", 0, True, [7], []) is None
    assert (index.num_blocks("r"), index.num_blocks("r", c.TIER_CPU)) == (1, 0)


@pytest.mark.parametrize("policy", ["prefix", "ttft"])
def test_blocks_loaded_from_the_cpu_tier_are_not_counted_as_kv_writes(policy: str) -> None:
    """The write balance (``recent_write_blocks``, both index policies) counts the new KV a
    request makes a replica write: a CPU-tier hit is loaded from host memory into the GPU, not
    computed, and stays on the host (write-through), so it is no new write, as ttft's evict
    term already assumes."""
    import asyncio
    import random

    from router.request.prompts import parse_prompt
    from router.shared import contract as c
    from tests.unit.router_service import MODEL, service_with_replicas

    service = service_with_replicas(2, policy=policy)
    for rid in ("replica-0", "replica-1"):
        service.fleet.apply_heartbeat(rid, {c.F_KV_TIERS: "GPU,CPU"}, 0.0)
    rng = random.Random(4)
    tokens = [rng.randrange(1000, 100_000) for _ in range(64 * 16 + 4)]  # 64 full blocks
    keys = service.fleet.hasher.keys(tokens)
    service.fleet.apply_changes("replica-0", service.fleet.replicas["replica-0"].epoch, False,
                                keys[:8], [], cpu_stored=keys[8:40])
    spec = parse_prompt("completion", {"model": MODEL, "prompt": tokens})

    async def scenario() -> None:
        routed = await service.router.route(spec)
        hit = routed.decision.hit("replica-0")
        assert routed.decision.replica_id == "replica-0", routed.decision.details
        assert (hit.blocks, hit.cpu_blocks) == (8, 32)
        dispatch = service.dispatcher.begin(routed, spec)
        dispatch.start_ticket("replica-0").finish()
        dispatch.sent("replica-0")
        assert dispatch.placements[0].blocks == 64 - 8 - 32
        assert service.tracker.recent_writes("replica-0", routed.write_window_blocks) == \
            pytest.approx(24)
        dispatch.settle(200, "replica-0")

    asyncio.run(scenario())
    service.chainer.shutdown(wait=True)
