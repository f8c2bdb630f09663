"""Tier-aware routing end to end, on the default (coarse) index: two emulated replicas with a
CPU tier (vLLM native offloading), a worker each, a real Redis and a router, all real processes
on loopback. A prompt whose blocks the GPU evicted but the host tier still holds gets a CPU-tier
hit depth (Redis contract version 4: resident keys per replica and tier) and is routed there;
with the tier invisible to the router (``--kv-tiers GPU``) it gets none."""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from router.shared import contract as c
from router.shared.hashing import BlockHasher
from tests.helpers import EMULATE, PYTHON, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import (
    KV_EVENTS,
    Router,
    http,
    prometheus_value,
    read_json_file,
)

pytestmark = pytest.mark.timeout(180)

NUM_REPLICAS = 2
PROMPT_BLOCKS = 8  # anchors of the default stride 16 at depths 0, 1, 3, 7: the last is block 8


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in reversed(started):
        print(stop_process(proc))


def start_fleet(tmp: Path, redis_url: str, tiers: str,
                procs: list[subprocess.Popen[bytes]]) -> list[dict[str, Any]]:
    """Two replicas of 12 GPU blocks (11 usable) and 64 host blocks, a worker each on the
    default index stride."""
    ready = tmp / "emulator.json"
    procs.append(start_process([
        *EMULATE, "--replicas", str(NUM_REPLICAS), "--kv-events-config", KV_EVENTS,
        "--num-gpu-blocks-override", "12", "--num-cpu-blocks-override", "64",
        "--enable-prompt-tokens-details", "--ready-file", str(ready)],
        env={"PYTHONHASHSEED": "0"}))
    replicas: list[dict[str, Any]] = wait_for(lambda: read_json_file(ready), 60,
                                              message="emulator ready file")["replicas"]
    for rep in replicas:
        procs.append(start_process([
            PYTHON, "-m", "worker.cli", "report", "--engine-url", rep["url"],
            "--kv-events-endpoint", rep["kv_events_endpoint"],
            "--kv-replay-endpoint", rep["kv_replay_endpoint"], "--redis-url", redis_url,
            "--replica-id", f"replica-{rep['index']}", "--advertise-url", rep["url"],
            "--hash-seed", "0", "--metrics-port", "0", "--kv-tiers", tiers]))
    return replicas


def members(client: redis.Redis, replica_id: str, tier: str) -> set[int]:
    raw = cast("set[bytes]", client.smembers(c.blocks_key("pr", replica_id, tier)))
    return {c.unpack_key(m) for m in raw}


def complete_on(url: str, prompt: list[int]) -> dict[str, Any]:
    status, _, body = http("POST", url + "/v1/completions",
                           {"model": "emulated-llm", "prompt": prompt, "max_tokens": 1})
    assert status == 200, body
    return cast("dict[str, Any]", json.loads(body))


@pytest.mark.parametrize("tiers", ["GPU,CPU", "GPU"])
def test_prompt_evicted_to_the_cpu_tier_is_routed_there(
        tiers: str, tmp_path: Path, redis_url: str,
        procs: list[subprocess.Popen[bytes]]) -> None:
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    replicas = start_fleet(tmp_path, redis_url, tiers, procs)
    rng = random.Random(17)
    prompt_a = [rng.randrange(100, 20_000) for _ in range(PROMPT_BLOCKS * 16 + 4)]
    keys_a = BlockHasher(16, "sha256", "0").keys(prompt_a)
    anchors = set(c.anchor_keys(keys_a, c.DEFAULT_INDEX_STRIDE))
    home = replicas[0]["url"]
    router = Router(tmp_path, ["--redis-url", redis_url, "--hash-seed", "0"])  # stride 16
    procs.append(router.proc)
    wait_for(lambda: len(router.ready().get("replicas", ())) == NUM_REPLICAS, 30,
             message="router sees both replicas")
    # Once both workers are verified, A goes straight to replica-0, then two other prompts of
    # ten blocks each take every GPU block there: A leaves the GPU, its copy stays on the host.
    wait_for(lambda: all(r.get("affinity") for r in router.ready()["replicas"]), 30,
             message="both replicas get prefix credit")
    complete_on(home, prompt_a)
    wait_for(lambda: anchors <= members(client, "replica-0", c.TIER_GPU), 20,
             message="A's anchors in replica-0's GPU tier")
    for _ in range(2):
        complete_on(home, [rng.randrange(100, 20_000) for _ in range(170)])
    wait_for(lambda: not anchors & members(client, "replica-0", c.TIER_GPU), 20,
             message="A's anchors evicted from replica-0's GPU")

    def decision() -> dict[str, Any]:
        return cast("dict[str, Any]",
                    json.loads(router.post("/debug/route", {"prompt": prompt_a})[2]))

    if tiers == "GPU,CPU":
        # contract version 4: the host copy is in the replica's CPU-tier set, placed on the
        # coarse index by the depth of its GPU store
        assert anchors <= members(client, "replica-0", c.TIER_CPU)
        wait_for(lambda: decision()["replicas"]["replica-0"]["cpu_hit_blocks"] == PROMPT_BLOCKS,
                 20, message="the router's CPU-tier hit on replica-0")
        d = decision()
        assert d["replica"] == "replica-0" and d["reason"] == "prefix_hit", d
        assert d["cpu_hit_blocks"] == PROMPT_BLOCKS and d["hit_blocks"] == 0
        assert d["replicas"]["replica-1"]["cpu_hit_blocks"] == 0
        # the index's CPU-tier gauge, read while the host copy is all there is (serving A below
        # loads it back and stores anew, and the gauges follow the stream a read later)
        wait_for(lambda: prometheus_value(http("GET", router.url + "/metrics")[2].decode(),
                                          "router_index_replica_cpu_blocks") >= len(anchors),
                 10, message="the CPU-tier gauge counts A's anchors")
        status, headers, body = router.post("/v1/completions", {
            "model": "emulated-llm", "prompt": prompt_a, "max_tokens": 1})
        assert status == 200 and headers["x-prefix-router-replica"] == "replica-0"
        # the engine served the prefix from its host tier (vLLM counts it in cached_tokens)
        usage = json.loads(body)["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == PROMPT_BLOCKS * 16
        text = http("GET", router.url + "/metrics")[2].decode()
        assert prometheus_value(
            text, 'router_predicted_hit_blocks_total{replica="replica-0",tier="CPU"}') \
            == PROMPT_BLOCKS
    else:
        # the tier invisible to the router: nothing in the CPU-tier set, no hit anywhere
        assert not members(client, "replica-0", c.TIER_CPU)

        def no_hit() -> bool:  # the router applies the stream a read interval after Redis
            return all(v["cpu_hit_blocks"] == 0 and v["hit_blocks"] == 0
                       for v in decision()["replicas"].values())

        wait_for(no_hit, 10, message="A's eviction from the GPU reached the router's index")
        d = decision()
        assert d["reason"] == "cold_ring"
    client.close()
