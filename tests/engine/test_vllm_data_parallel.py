"""Data-parallel ranks on the CPU build: one vLLM server with ``--data-parallel-size 2`` (two
engine cores, each publishing its KV events on its own port, rank r at the endpoint's port + r),
one worker reporting both ranks, and a router that targets a rank with vLLM's
``X-data-parallel-rank`` header. Each rank is probed and verified, and the router's predicted
hit on the rank it picks equals that rank's ``cached_tokens``.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from loadtest.harness.redis_server import RedisServer
from loadtest.harness.vllm_engine import KVEventTap, VllmEngine
from router.shared import contract
from tests.helpers import PYTHON, start_process, stop_process, wait_for, wait_ready
from tests.integration.test_router_fleet import http

# the package's engines start together when the first is needed (conftest.EnginePool)
pytestmark = pytest.mark.timeout(2700)

RANKS = ("dp-engine#0", "dp-engine#1")  # the worker names rank r's routing target <id>#<r>
SETTLE_S = 120.0  # bound on waits for probes, heartbeats and the index: generous when busy
# the module's own key prefix in the session's Redis: the package's pair (``engine_fleet``) may be
# up at the same time, its workers registering the same model under the default prefix, and a
# router on that prefix would route to the pair as well (a whole-package run timed out waiting
# for "both ranks" with four routable replicas)
REDIS_PREFIX = "dp"


@pytest.fixture
def taps(dp_engine: VllmEngine) -> Iterator[dict[str, KVEventTap]]:
    """One tap per rank, keyed by routing target, connected before the worker starts: the
    module's engine has served nothing before, so each tap sees every block its rank caches
    (the worker's probes included)."""
    out = {target: KVEventTap(dp_engine.endpoints(rank)[0]) for rank, target in enumerate(RANKS)}
    yield out
    for tap in out.values():
        tap.close()


@pytest.fixture
def fleet(dp_engine: VllmEngine, redis_server: RedisServer, taps: dict[str, KVEventTap],
          tmp_path: Path) -> Iterator[tuple[str, redis.Redis]]:
    """The worker (both ranks) and a router on the module's own Redis prefix, started after the
    ``taps``; ``(router URL, Redis client)``."""
    client = redis.Redis.from_url(redis_server.url)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(start_process([
            PYTHON, "-m", "worker.cli", "report", "--engine-url", dp_engine.url,
            "--kv-events-endpoint", dp_engine.kv_events_endpoint,
            "--kv-replay-endpoint", dp_engine.kv_replay_endpoint, "--data-parallel-size", "2",
            "--redis-url", redis_server.url, "--redis-prefix", REDIS_PREFIX, "--replica-id",
            "dp-engine", "--hash-seed", "0", "--index-stride", "1"]))
        ready = tmp_path / "router.json"
        procs.append(start_process([
            PYTHON, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", "0",
            "--ready-file", str(ready), "--redis-url", redis_server.url,
            "--redis-prefix", REDIS_PREFIX, "--block-size", "32", "--hash-seed", "0",
            "--index-stride", "1"]))
        url = wait_ready(ready, procs, 120, "the router's ready file")["url"]
        yield url, client
    finally:
        for proc in reversed(procs):
            print(stop_process(proc)[-4000:])  # shown on failure
        client.close()


def heartbeat(client: redis.Redis, replica_id: str) -> dict[str, str]:
    raw: Any = client.hgetall(contract.replica_key(REDIS_PREFIX, replica_id))
    return {k.decode(): v.decode() for k, v in raw.items()}


def test_both_ranks_are_verified_and_predicted_hits_equal_cached_tokens(
        dp_engine: VllmEngine, fleet: tuple[str, redis.Redis],
        taps: dict[str, KVEventTap]) -> None:
    router_url, client = fleet
    wait_for(lambda: all(heartbeat(client, r).get(contract.F_HASH_VERIFIED) == "1"
                         for r in RANKS), 2 * SETTLE_S, message="both ranks verified by their probes")
    assert [heartbeat(client, r)[contract.F_DP_RANK] for r in RANKS] == ["0", "1"]

    def ready() -> dict[str, Any]:
        return json.loads(http("GET", router_url + "/ready")[2])

    wait_for(lambda: sum(r["routable"] and r["affinity"] for r in ready()["replicas"]) == 2, SETTLE_S,
             message="the router routes to both ranks")
    rng = random.Random(31)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(6 * 32 + 5)] for _ in range(4)]
    results = []
    for tokens in [*prompts, *prompts]:  # the second round hits where the first went
        # the claim: the prediction is exact once the events have arrived (a snapshot of the
        # index taken before the previous request's events came never matched again)
        wait_for(lambda: {r["replica_id"]: r["index_blocks"] for r in ready()["replicas"]}
                 == {target: len(tap.resident()) for target, tap in taps.items()}, SETTLE_S,
                 0.5, "the router's index to match each rank's KV events")
        status, headers, raw = http("POST", router_url + "/v1/completions", {
            "model": dp_engine.model, "prompt": tokens, "max_tokens": 1}, timeout=300)
        assert status == 200, raw
        cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
        results.append((headers["x-prefix-router-replica"],
                        int(headers["x-prefix-router-confirmed-hit-tokens"]), cached))
    assert all(predicted == cached for _, predicted, cached in results), results
    assert all(cached == 6 * 32 for _, _, cached in results[4:]), results  # every repeat hit
