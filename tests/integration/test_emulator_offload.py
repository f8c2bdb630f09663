"""Integration test: a real emulator process with a CPU tier (vLLM native KV offloading)."""

from __future__ import annotations

from typing import Any

import pytest

from router.shared.kv_events import BlockRemoved, BlockStored
from tests.helpers import wait_for
from tests.integration.test_emulator import (
    EVENTS,
    completion,
    get,
    metric,
    replay_events,
    start_emulator,  # noqa: F401  (fixture)
)

pytestmark = pytest.mark.timeout(120)


def test_cpu_tier_holds_what_the_gpu_evicted(start_emulator: Any) -> None:  # noqa: F811
    # 1 null block + 8 usable GPU blocks; 32 CPU blocks.
    emu = start_emulator("--num-gpu-blocks-override", "9", "--num-cpu-blocks-override", "32",
                         "--enable-prompt-tokens-details", "--kv-events-config", EVENTS,
                         "--time-scale", "100")
    url, replay = emu.url, emu.replicas[0]["kv_replay_endpoint"]
    a = list(range(1, 97))  # 6 blocks
    completion(url, a, max_tokens=1)

    def cpu_stored() -> list[BlockStored]:
        return [e for e in replay_events(replay)
                if isinstance(e, BlockStored) and e.medium == "CPU"]

    # The copy ends after the request did: the engine publishes it while idle.
    wait_for(lambda: len(cpu_stored()) == 1, timeout_s=10, message="CPU BlockStored")
    gpu_a = next(e for e in replay_events(replay) if isinstance(e, BlockStored))
    (cpu_a,) = cpu_stored()
    assert gpu_a.medium == "GPU" and cpu_a.block_hashes == gpu_a.block_hashes
    assert cpu_a.parent_block_hash is None and cpu_a.token_ids == [] and cpu_a.block_size == 16
    for start in (1000, 2000):  # two 6-block prompts take all of a's GPU blocks
        completion(url, list(range(start, start + 96)), max_tokens=1)
    events = replay_events(replay)
    gpu_removed = {h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU"
                   for h in e.block_hashes}
    assert set(gpu_a.block_hashes) <= gpu_removed
    assert not any(isinstance(e, BlockRemoved) and e.medium == "CPU" for e in events)
    # The same prompt again: no GPU hit, six blocks loaded from the host; vLLM reports them
    # as cached tokens (local + external) and in the external prefix-cache counters.
    reply = completion(url, [*a, 5], max_tokens=1)
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    text = get(url + "/metrics")
    assert metric(text, "vllm:prefix_cache_hits_total") == 0
    assert metric(text, "vllm:external_prefix_cache_hits_total") == 96
    assert metric(text, "vllm:external_prefix_cache_queries_total") == 96 * 3 + 97
    assert metric(text, "vllm:prompt_tokens_cached_total") == 96
    block_bytes = 2 * 32 * 8 * 128 * 2 * 16
    loads = [line for line in text.splitlines()
             if line.startswith("vllm:kv_offload_total_bytes_total") and "CPU_to_GPU" in line]
    assert loads and float(loads[0].rsplit(" ", 1)[1]) == 6 * block_bytes
    assert 0 < metric(text, "emulator_cpu_kv_cache_usage_perc") <= 1
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
