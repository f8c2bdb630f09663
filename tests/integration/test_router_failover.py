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


STATUS_SERVER = """
import sys
from aiohttp import web
STATUS = int(sys.argv[2])
async def completions(request):
    await request.read()
    if STATUS != 200:
        return web.json_response({"error": {"message": f"replica says {STATUS}", "type": "X",
                                            "code": STATUS}}, status=STATUS)
    return web.json_response({"id": "ok", "object": "text_completion", "choices": []})
async def health(request):
    return web.json_response({})
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "fixed", "object": "model"}]})
app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""


def test_502_and_504_before_any_byte_are_retried_on_the_next_replica(tmp_path: Path) -> None:
    from tests.helpers import free_port

    script = tmp_path / "status_server.py"
    script.write_text(STATUS_SERVER)
    servers = {}
    routers: list[Router] = []
    try:
        for status in (200, 502, 504):
            port = free_port()
            servers[status] = (start_process([PYTHON, str(script), str(port), str(status)]),
                               f"127.0.0.1:{port}")
        for _, rid in servers.values():
            wait_for(lambda rid=rid: http("GET", f"http://{rid}/health")[0] == 200, 20)
        rng = random.Random(4)
        for bad in (502, 504):  # one failing and one good replica behind each router
            bad_id, good_id = servers[bad][1], servers[200][1]
            router = Router(tmp_path, ["--replica", f"http://{bad_id}", "--replica",
                                       f"http://{good_id}"])
            routers.append(router)
            # a prompt whose first choice is the failing replica
            for _ in range(200):
                body = {"model": "fixed", "prompt": [rng.randrange(1000, 90_000) for _ in range(40)]}
                if json.loads(router.post("/debug/route", body)[2])["replica"] == bad_id:
                    break
            else:
                raise AssertionError(f"no prompt routed to {bad_id}")
            status, headers, raw = router.post("/v1/completions", body)
            assert status == 200, raw[:200]
            assert headers["x-prefix-router-replica"] == good_id
            metrics = router.metrics()
            assert f'router_upstream_retries_total{{cause="http_{bad}"}} 1.0' in metrics
            assert (f'router_upstream_errors_total{{kind="http_{bad}",replica="{bad_id}"}} 1.0'
                    in metrics)
    finally:
        for router in routers:
            router.stop()
        for proc, _ in servers.values():
            stop_process(proc)


def test_last_replica_answering_503_is_relayed(tmp_path: Path) -> None:
    from tests.helpers import free_port

    script = tmp_path / "status_server.py"
    script.write_text(STATUS_SERVER)
    port = free_port()
    server = start_process([PYTHON, str(script), str(port), "503"])
    router = None
    try:
        wait_for(lambda: http("GET", f"http://127.0.0.1:{port}/health")[0] == 200, 20)
        router = Router(tmp_path, ["--replica", f"http://127.0.0.1:{port}"])
        status, headers, raw = router.post("/v1/completions", {"model": "fixed", "prompt": [1, 2]})
        assert status == 503 and json.loads(raw)["error"]["message"] == "replica says 503"
        assert headers["x-prefix-router-replica"] == f"127.0.0.1:{port}"
    finally:
        if router is not None:
            router.stop()
        stop_process(server)
