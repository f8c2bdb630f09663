"""A killed replica: requests are retried elsewhere at once, and it leaves rotation within one TTL.

Two emulator processes (one replica each, so one can be killed), a worker each, real Redis,
one router.
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from router.contract import HEARTBEAT_TTL_S
from tests.helpers import PYTHON, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import KV_EVENTS, Router, http, read_json_file

pytestmark = pytest.mark.timeout(120)


def test_killed_replica_leaves_rotation_and_requests_are_retried(redis_url: str,
                                                                 tmp_path: Path) -> None:
    procs: list[Any] = []
    router = None
    try:
        replicas = []
        for i in range(2):
            ready = tmp_path / f"emu{i}.json"
            emu = start_process([PYTHON, "-m", "worker.cli", "emulate", "--host", "127.0.0.1",
                                 "--port", "0", "--kv-events-config", KV_EVENTS, "--time-scale",
                                 "50", "--ready-file", str(ready)], env={"PYTHONHASHSEED": "0"})
            procs.append(emu)
            rep = wait_for(lambda ready=ready: read_json_file(ready), 60)["replicas"][0]
            worker = start_process([
                PYTHON, "-m", "worker.cli", "report", "--engine-url", rep["url"],
                "--kv-events-endpoint", rep["kv_events_endpoint"], "--kv-replay-endpoint",
                rep["kv_replay_endpoint"], "--redis-url", redis_url, "--replica-id",
                f"replica-{i}", "--advertise-url", rep["url"], "--hash-seed", "0",
                "--metrics-port", "0"])
            procs.append(worker)
            replicas.append((emu, worker, rep))
        router = Router(tmp_path, ["--redis-url", redis_url, "--hash-seed", "0"])
        wait_for(lambda: sum(r["routable"] for r in router.ready()["replicas"]) == 2, 30,
                 message="both replicas routable")
        rng = random.Random(2)
        prompts = [[rng.randrange(1000, 90_000) for _ in range(64)] for _ in range(20)]
        homes = {}
        for p in prompts:
            status, headers, _ = router.post("/v1/completions", {"prompt": p, "max_tokens": 1})
            assert status == 200
            homes[json.dumps(p)] = headers["x-prefix-router-replica"]
        assert set(homes.values()) == {"replica-0", "replica-1"}

        replicas[1][0].send_signal(signal.SIGKILL)
        replicas[1][0].wait()
        killed_at = time.monotonic()
        # requests whose home was the dead replica are retried elsewhere before any byte
        for p in prompts:
            status, headers, body = router.post("/v1/completions", {"prompt": p, "max_tokens": 1})
            assert status == 200, body[:200]
            assert headers["x-prefix-router-replica"] == "replica-0"

        def out_of_rotation() -> bool:
            reps = {r["replica_id"]: r for r in router.ready()["replicas"]}
            return "replica-1" not in reps or not reps["replica-1"]["routable"]

        wait_for(out_of_rotation, HEARTBEAT_TTL_S + 3, message="dead replica out of rotation")
        assert time.monotonic() - killed_at < HEARTBEAT_TTL_S + 3
        # worker-reported expiry too (not only the router's passive failure marking)
        wait_for(lambda: "replica-1" not in {r["replica_id"] for r in router.ready()["replicas"]},
                 HEARTBEAT_TTL_S + 5, message="heartbeat of the dead replica expired")
        metrics = http("GET", router.url + "/metrics")[2].decode()
        assert "router_upstream_retries_total" in metrics
    finally:
        if router is not None:
            print(router.stop()[-3000:])
        for proc in reversed(procs):
            stop_process(proc)
