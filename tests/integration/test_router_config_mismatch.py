"""A replica whose engine hashes blocks of another size than the router's (engine 32 tokens,
router 16) through real processes: two emulators (16 and 32 tokens per block), a worker each,
real Redis, a router.

Its keys can never match the router's: it is a ``config_mismatch`` on ``/ready`` and in
``router_replica_config_mismatch``, and it takes no traffic while the matched replica serves the
model; alone, it is still routed to (on load, no prefix-hit credit).
"""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from tests.helpers import PYTHON, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import Router, prometheus_value
from tests.integration.test_worker_emulator import SEED, Emulator, start_emulator

pytestmark = pytest.mark.timeout(180)

MODEL = "emulated-llm"


def start_worker(emu: Emulator, redis_url: str, replica_id: str) -> subprocess.Popen[bytes]:
    return start_process([PYTHON, "-m", "worker.cli", "report", "--engine-url", emu.url,
                          "--kv-events-endpoint", emu.events, "--kv-replay-endpoint", emu.replay,
                          "--redis-url", redis_url, "--replica-id", replica_id,
                          "--hash-seed", SEED, "--metrics-port", "0", "--index-stride", "1"])


def test_a_block_size_mismatch_is_a_config_mismatch_and_draws_no_traffic(
        redis_url: str, tmp_path: Path) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    router: Router | None = None
    try:
        matched = start_emulator(tmp_path)
        procs.append(matched.proc)
        other = start_emulator(tmp_path, extra=("--block-size", "32"))
        procs.append(other.proc)
        procs += [start_worker(matched, redis_url, "replica-16"),
                  start_worker(other, redis_url, "replica-32")]
        router = Router(tmp_path, ["--redis-url", redis_url, "--hash-seed", SEED,
                                   "--index-stride", "1"])
        wait_for(lambda: len(router.ready()["replicas"]) == 2, 60, message="both replicas")
        wait_for(lambda: router.ready()["config_mismatches"] == ["replica-32"], 30,
                 message="the 32-token replica a config mismatch")
        ready = router.ready()
        reasons = {r["replica_id"]: r["config_mismatch"] for r in ready["replicas"]}
        assert reasons == {"replica-16": None, "replica-32": "block_size 32 != router's 16"}
        assert ready["ready"] is True
        wait_for(lambda: prometheus_value(router.metrics(), "router_replica_config_mismatch")
                 == 1, 10, message="mismatch gauge")
        rng = random.Random(34)
        chosen = []
        for _ in range(20):
            prompt = [rng.randrange(1000, 30000) for _ in range(64)]
            status, headers, _ = router.post("/v1/completions", {
                "model": MODEL, "prompt": prompt, "max_tokens": 1})
            assert status == 200
            chosen.append(headers["x-prefix-router-replica"])
        assert chosen == ["replica-16"] * 20
        # alone, the mismatched replica still serves (on load, no credit)
        procs[0].terminate()
        wait_for(lambda: [r["replica_id"] for r in router.ready()["replicas"]
                          if r["routable"]] == ["replica-32"], 30, message="replica-16 gone")
        status, headers, _ = router.post("/v1/completions", {
            "model": MODEL, "prompt": [5] * 64, "max_tokens": 1})
        assert status == 200 and headers["x-prefix-router-replica"] == "replica-32"
    finally:
        if router is not None:
            router.stop()
        for proc in reversed(procs):
            stop_process(proc)
