"""Tier-tagged KV events end to end: an emulator with a CPU tier (vLLM native offloading), its
worker, a real Redis and a router, all real processes on loopback."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import requests

from router.shared import contract
from tests.helpers import free_port, wait_for
from tests.integration.test_emulator import metric
from tests.integration.test_router_fleet import Router
from tests.integration.test_worker_emulator import (
    Redis,
    complete,
    procs,  # noqa: F401  (fixture)
    prompt,
    rds,  # noqa: F401  (fixture)
    router_keys,
    start_emulator,
    start_worker,
    tmp,  # noqa: F401  (fixture)
    verified,
)

pytestmark = pytest.mark.timeout(150)


@pytest.mark.parametrize("tiers", ["GPU,CPU", "GPU"])
def test_cpu_tier_keeps_evicted_prefixes_routable(
        tiers: str, tmp: Path, rds: Redis, redis_url: str,  # noqa: F811
        procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    rng = random.Random(7)
    emu = start_emulator(tmp, num_gpu_blocks=12, extra=("--num-cpu-blocks-override", "64"))
    procs.append(emu.proc)
    procs.append(start_worker(emu, redis_url, extra=("--kv-tiers", tiers, "--metrics-port", "0")))
    wait_for(lambda: verified(rds), 30, message="hash probe verified")
    tokens_a = prompt(40, rng)
    keys_a = set(router_keys(tokens_a))
    complete(emu, tokens_a)
    wait_for(lambda: keys_a <= rds.blocks(), 20, message="request A's keys")
    # Two 170-token prompts take every GPU block: A leaves the GPU, its copy stays on the host.
    for _ in range(2):
        tokens_b = prompt(170, rng)
        complete(emu, tokens_b)
    keys_b = set(router_keys(tokens_b))
    wait_for(lambda: keys_b <= rds.blocks(), 20, message="B's keys")
    router = Router(tmp, ["--redis-url", redis_url, "--hash-seed", "0", "--index-stride", "1"])
    procs.append(router.proc)
    wait_for(lambda: router.ready().get("replicas"), 30, message="router sees the replica")

    def hit_blocks() -> tuple[int, int]:
        decision = json.loads(router.post("/debug/route", {"prompt": [*tokens_a, 9, 9]})[2])
        return (max(v["confirmed_hit_blocks"] for v in decision["replicas"].values()),
                max(v["cpu_hit_blocks"] for v in decision["replicas"].values()))

    # Either way A's keys left the GPU tier's set with its GPU copy.
    wait_for(lambda: not keys_a & rds.blocks(), 20, message="A's keys removed from the GPU tier")
    if tiers == "GPU,CPU":
        # The demotion is not a removal: A's prefix stays in Redis (CPU tier) and in the
        # router's index, as a CPU-tier hit (contract version 4: one set per tier).
        assert keys_a <= rds.cpu_blocks()
        assert rds.heartbeat()[contract.F_KV_TIERS] == "GPU,CPU"
        wait_for(lambda: hit_blocks() == (0, 2), 20, message="router CPU-tier hit")
    else:
        assert not rds.cpu_blocks() and rds.heartbeat()[contract.F_KV_TIERS] == "GPU"
        assert hit_blocks() == (0, 0)
    reply = requests.post(f"{emu.url}/v1/completions", timeout=30, json={
        "model": "emulated-llm", "prompt": [*tokens_a, 9, 9], "max_tokens": 1}).json()
    assert reply["usage"]["prompt_tokens"] == 42
    # Either way the engine itself serves A's two blocks from its host tier.
    text = requests.get(f"{emu.url}/metrics", timeout=10).text
    assert metric(text, "vllm:external_prefix_cache_hits_total") == 32


@pytest.mark.parametrize("stride", ["1", "16"])  # the exact index and the default coarse one
def test_cpu_tier_under_recomputed_keys(stride: str, tmp: Path, rds: Redis,  # noqa: F811
                                        redis_url: str,
                                        procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    """An engine hashing with another seed (key_mode=recomputed): the connector's host stores
    carry no tokens to re-hash, so the worker keys them by the digest the GPU store of the same
    engine hash gave, and they stay routable after the GPU evicts them. (A's two blocks, at
    depths 0 and 1, are anchors on either index.)"""
    rng = random.Random(8)
    emu = start_emulator(tmp, seed="123", num_gpu_blocks=12,
                         extra=("--num-cpu-blocks-override", "64"))
    procs.append(emu.proc)
    metrics_port = free_port()
    procs.append(start_worker(emu, redis_url, extra=("--metrics-port", str(metrics_port),
                                                     "--index-stride", stride)))
    wait_for(lambda: rds.heartbeat().get(contract.F_KEY_MODE) == "recomputed", 30,
             message="key_mode recomputed")
    tokens_a = prompt(40, rng)
    ours, engines = set(router_keys(tokens_a)), set(router_keys(tokens_a, "123"))
    complete(emu, tokens_a)
    wait_for(lambda: ours <= rds.blocks() and ours <= rds.cpu_blocks(), 20,
             message="A's re-computed keys on both tiers")
    for _ in range(2):  # take every GPU block: A leaves the GPU, its copy stays on the host
        complete(emu, prompt(170, rng))
    wait_for(lambda: not ours & rds.blocks(), 20, message="A's keys removed from the GPU tier")
    assert ours <= rds.cpu_blocks() and not engines & (rds.blocks() | rds.cpu_blocks())
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    assert metric(text, 'worker_tier_events_total{medium="CPU"}') > 0
    assert metric(text, 'worker_skipped_events_total{reason="no_chain"}') == 0
    assert metric(text, "worker_bad_events_total") == 0
    router = Router(tmp, ["--redis-url", redis_url, "--hash-seed", "0", "--index-stride", stride])
    procs.append(router.proc)
    wait_for(lambda: router.ready().get("replicas"), 30, message="router sees the replica")

    def cpu_hit_blocks() -> int:
        decision = json.loads(router.post("/debug/route", {"prompt": [*tokens_a, 9, 9]})[2])
        return max(v["cpu_hit_blocks"] for v in decision["replicas"].values())

    wait_for(lambda: cpu_hit_blocks() == 2, 20, message="router CPU-tier hit")
