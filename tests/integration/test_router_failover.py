"""A killed replica: requests are retried elsewhere at once, and it leaves rotation within one TTL.

Two emulator processes (one replica each, so one can be killed), a worker each, real Redis,
one router.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from router.shared.contract import HEARTBEAT_TTL_S
from tests.helpers import (
    EMULATE,
    FAKE_REPLICA_TAIL,
    PYTHON,
    ReplicaFeed,
    start_process,
    start_script_replica,
    stop_all,
    stop_process,
    wait_for,
    wait_routable,
)
from tests.integration.test_router_fleet import (
    KV_EVENTS,
    Router,
    http,
    prometheus_value,
    read_json_file,
)

pytestmark = pytest.mark.timeout(120)


def test_killed_replica_leaves_rotation_and_requests_are_retried(redis_url: str,
                                                                 tmp_path: Path) -> None:
    procs: list[Any] = []
    router = None
    try:
        replicas = []
        for i in range(2):
            ready = tmp_path / f"emu{i}.json"
            emu = start_process([*EMULATE, "--kv-events-config", KV_EVENTS, "--time-scale",
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
        # requests whose home was the dead replica are retried elsewhere before any byte
        for p in prompts:
            status, headers, body = router.post("/v1/completions", {"prompt": p, "max_tokens": 1})
            assert status == 200, body[:200]
            assert headers["x-prefix-router-replica"] == "replica-0"

        def out_of_rotation() -> bool:
            reps = {r["replica_id"]: r for r in router.ready()["replicas"]}
            return "replica-1" not in reps or not reps["replica-1"]["routable"]

        # generous bounds: how soon is the heartbeat's TTL, not this machine's speed
        wait_for(out_of_rotation, HEARTBEAT_TTL_S + 30, message="dead replica out of rotation")
        # worker-reported expiry too (not only the router's passive failure marking)
        wait_for(lambda: "replica-1" not in {r["replica_id"] for r in router.ready()["replicas"]},
                 HEARTBEAT_TTL_S + 30, message="heartbeat of the dead replica expired")
        metrics = http("GET", router.url + "/metrics")[2].decode()
        assert "router_upstream_retries_total" in metrics
    finally:
        if router is not None:
            print(router.stop()[-3000:])
        for proc in reversed(procs):
            stop_process(proc)


def _replica_with_worker(redis_url: str, tmp_path: Path, i: int, time_scale: str,
                         procs: list[Any]) -> tuple[Any, Any]:
    """One emulator process (one replica, ``replica-i``) and its worker: (emulator, worker)."""
    ready = tmp_path / f"emu{i}.json"
    emu = start_process([*EMULATE, "--kv-events-config", KV_EVENTS, "--time-scale", time_scale,
                         "--ready-file", str(ready)], env={"PYTHONHASHSEED": "0"})
    procs.append(emu)
    rep = wait_for(lambda: read_json_file(ready), 60)["replicas"][0]
    worker = start_process([
        PYTHON, "-m", "worker.cli", "report", "--engine-url", rep["url"],
        "--kv-events-endpoint", rep["kv_events_endpoint"], "--kv-replay-endpoint",
        rep["kv_replay_endpoint"], "--redis-url", redis_url, "--replica-id", f"replica-{i}",
        "--advertise-url", rep["url"], "--hash-seed", "0", "--metrics-port", "0"])
    procs.append(worker)
    return emu, worker


@pytest.mark.timeout(300)
def test_a_request_waiting_on_a_replica_that_leaves_the_fleet_moves(redis_url: str,
                                                                      tmp_path: Path) -> None:
    """A request waiting for its first byte on a replica that then hangs and leaves the fleet
    (its worker gone, its heartbeat expired) is moved to the next replica: the departed
    replica's health record, and with it the request's deadline, is forgotten, so before this
    it waited for ``first_byte_timeout_s`` (600 s). The first-byte deadline floor is set far
    above the heartbeat's TTL here, so only the departure can move it."""
    procs: list[Any] = []
    router = None
    try:
        _replica_with_worker(redis_url, tmp_path, 0, "50", procs)
        slow, worker = _replica_with_worker(redis_url, tmp_path, 1, "1", procs)
        router = Router(tmp_path, ["--redis-url", redis_url, "--hash-seed", "0",
                                   "--first-byte-deadline-floor-s", "250"])
        wait_for(lambda: sum(r["routable"] for r in router.ready()["replicas"]) == 2, 30,
                 message="both replicas routable")
        rng = random.Random(5)
        for _ in range(200):  # a prompt whose first choice is replica-1
            body = {"prompt": [rng.randrange(1000, 90_000) for _ in range(40)],
                    "max_tokens": 3000, "ignore_eos": True}
            if json.loads(router.post("/debug/route", body)[2])["replica"] == "replica-1":
                break
        answers: list[tuple[int, dict[str, str]]] = []
        client = threading.Thread(target=lambda: answers.append(
            router.post("/v1/completions", body, timeout=200)[:2]))
        client.start()
        # the request is decoding on replica-1 (time scale 1: a minute of decode) when it hangs
        wait_for(lambda: prometheus_value(router.metrics(), "router_inflight_requests") >= 1, 30,
                 message="the request in flight")
        slow.send_signal(signal.SIGSTOP)
        worker.send_signal(signal.SIGKILL)
        client.join(220)
        assert answers, "no answer"
        status, headers = answers[0]
        assert status == 200
        assert headers["x-prefix-router-replica"] == "replica-0"
        assert "replica-1" not in {r["replica_id"] for r in router.ready()["replicas"]}
    finally:
        if router is not None:
            print(router.stop()[-3000:])
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
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
    return web.json_response({"id": "ok", "object": "text_completion", "choices": []})""" + FAKE_REPLICA_TAIL


def prompt_routed_to(router: Router, replica_id: str, rng: random.Random) -> dict[str, Any]:
    """A completion body whose first choice (per ``/debug/route``) is ``replica_id``."""
    for _ in range(200):
        body = {"model": "fixed", "prompt": [rng.randrange(1000, 90_000) for _ in range(40)]}
        if json.loads(router.post("/debug/route", body)[2])["replica"] == replica_id:
            return body
    raise AssertionError(f"no prompt routed to {replica_id}")


def test_502_and_504_before_any_byte_are_retried_on_the_next_replica(tmp_path: Path) -> None:
    servers = {}
    routers: list[Router] = []
    try:
        for status in (200, 502, 504):
            proc, port = start_script_replica(STATUS_SERVER, str(status), name=f"{status} replica")
            servers[status] = (proc, f"127.0.0.1:{port}")
        rng = random.Random(4)
        for bad in (502, 504):  # one failing and one good replica behind each router
            bad_id, good_id = servers[bad][1], servers[200][1]
            router = Router(tmp_path, ["--replica", f"http://{bad_id}", "--replica",
                                       f"http://{good_id}"])
            routers.append(router)
            body = prompt_routed_to(router, bad_id, rng)
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
    server, port = start_script_replica(STATUS_SERVER, "503", name="503 replica")
    router = None
    try:
        router = Router(tmp_path, ["--replica", f"http://127.0.0.1:{port}"])
        status, headers, raw = router.post("/v1/completions", {"model": "fixed", "prompt": [1, 2]})
        assert status == 503 and json.loads(raw)["error"]["message"] == "replica says 503"
        assert headers["x-prefix-router-replica"] == f"127.0.0.1:{port}"
    finally:
        stop_all(router, server)


POISON_SERVER = """
import json, sys
from aiohttp import web
async def completions(request):
    body = json.loads(await request.read())
    if body.get("prompt") == [13]:  # this request makes the replica drop the connection
        request.transport.close()
        return web.Response()
    return web.json_response({"id": "ok", "object": "text_completion", "choices": []})""" + FAKE_REPLICA_TAIL


def test_one_request_dropped_by_every_replica_does_not_bench_the_fleet(tmp_path: Path) -> None:
    """A dropped connection may be about the request, not the replica: only refused or timed-out
    connections bench a replica, so the next requests are served at once."""
    servers: list[Any] = []
    ports: list[int] = []
    router = None
    try:
        for _ in range(2):
            server, port = start_script_replica(POISON_SERVER, name="poison replica")
            servers.append(server)
            ports.append(port)
        router = Router(tmp_path, [arg for port in ports
                                   for arg in ("--replica", f"http://127.0.0.1:{port}")])
        status, headers, raw = router.post("/v1/completions", {"model": "fixed", "prompt": [13]})
        assert status == 502 and "error" in json.loads(raw)
        # the message names every replica tried, the one the header names among them (issue 34:
        # the header named one replica while the message named only the last one tried)
        message = json.loads(raw)["error"]["message"]
        tried = {f"127.0.0.1:{port}" for port in ports}
        assert all(f"replica {rid}: " in message for rid in tried), message
        assert headers["x-prefix-router-replica"] in tried
        for i in range(4):
            status, _, raw = router.post("/v1/completions", {"model": "fixed", "prompt": [20 + i]})
            assert status == 200, raw[:300]
    finally:
        stop_all(router, *servers)


GARBLED_SERVER = """
import asyncio, json, sys
async def handle(reader, writer):
    head = await reader.readuntil(b"\\r\\n\\r\\n")
    line = head.split(b"\\r\\n", 1)[0].decode()
    length = 0
    for h in head.split(b"\\r\\n")[1:]:
        if h.lower().startswith(b"content-length:"):
            length = int(h.split(b":", 1)[1])
    if length:
        await reader.readexactly(length)
    if "/v1/completions" in line:
        writer.write(b"NOT HTTP AT ALL\\r\\n\\r\\n")  # a replica that does not speak HTTP
    else:
        body = json.dumps({"object": "list", "data": [{"id": "fixed", "object": "model"}]}).encode()
        writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Type: application/json\\r\\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\\r\\n\\r\\n" + body)
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


def test_a_replica_answering_garbage_is_retried_elsewhere_and_benched(tmp_path: Path) -> None:
    from tests.helpers import free_port

    (tmp_path / "garbled.py").write_text(GARBLED_SERVER)
    bad_port = free_port()
    servers = [start_process([PYTHON, str(tmp_path / "garbled.py"), str(bad_port)])]
    router = None
    try:
        wait_for(lambda: http("GET", f"http://127.0.0.1:{bad_port}/health")[0] == 200, 20)
        good, good_port = start_script_replica(STATUS_SERVER, "200", name="good replica")
        servers.append(good)
        bad_id, good_id = f"127.0.0.1:{bad_port}", f"127.0.0.1:{good_port}"
        router = Router(tmp_path, ["--replica", f"http://{bad_id}", "--replica", f"http://{good_id}"])
        rng = random.Random(8)
        body = prompt_routed_to(router, bad_id, rng)
        status, headers, raw = router.post("/v1/completions", body)
        assert status == 200 and headers["x-prefix-router-replica"] == good_id, raw[:300]
        assert (f'router_upstream_errors_total{{kind="bad_response",replica="{bad_id}"}} 1.0'
                in router.metrics())
        for _ in range(5):  # benched for a few seconds: everything goes to the good one
            status, headers, _ = router.post("/v1/completions", body)
            assert status == 200 and headers["x-prefix-router-replica"] == good_id
    finally:
        stop_all(router, *servers)


def _emulated_fleet(redis_url: str, tmp_path: Path, num: int) -> list[Any]:
    ready = tmp_path / "emu-fleet.json"
    procs = [start_process([*EMULATE, "--replicas", str(num), "--kv-events-config", KV_EVENTS,
                            "--time-scale", "50", "--ready-file", str(ready)],
                           env={"PYTHONHASHSEED": "0"})]
    for rep in wait_for(lambda: read_json_file(ready), 60)["replicas"]:
        procs.append(start_process([
            PYTHON, "-m", "worker.cli", "report", "--engine-url", rep["url"],
            "--kv-events-endpoint", rep["kv_events_endpoint"], "--kv-replay-endpoint",
            rep["kv_replay_endpoint"], "--redis-url", redis_url, "--replica-id",
            f"replica-{rep['index']}", "--advertise-url", rep["url"], "--hash-seed", "0",
            "--metrics-port", "0"]))
    return procs


def test_redis_outage_keeps_routing_and_index_resyncs_after_restart(tmp_path: Path) -> None:
    from loadtest.harness.redis_server import RedisServer

    redis = RedisServer().start()
    procs: list[Any] = []
    router = None
    try:
        procs = _emulated_fleet(redis.url, tmp_path, 2)
        router = Router(tmp_path, ["--redis-url", redis.url, "--hash-seed", "0"])
        wait_routable(router, 2, procs)
        rng = random.Random(6)

        def prompt() -> list[int]:
            return [rng.randrange(1000, 90_000) for _ in range(160)]

        def confirmed_hit(p: list[int]) -> bool:
            d = json.loads(router.post("/debug/route", {"prompt": p})[2])
            # 9 full blocks beyond the last token; the default coarse index (stride 16) holds the
            # anchors at positions 0, 1, 3 and 7 of them: a confirmed depth of 8
            return any(v["confirmed_hit_blocks"] >= 8 for v in d["replicas"].values())

        before = prompt()
        assert router.post("/v1/completions", {"prompt": before, "max_tokens": 1})[0] == 200
        wait_for(lambda: confirmed_hit(before), 15, message="KV events reach the index")

        redis.stop()
        wait_for(lambda: router.ready()["redis"]["connected"] is False, 15, message="redis down")
        # routing goes on: ring placement and the router's own speculative placements
        during = prompt()
        homes = set()
        reasons = set()
        for _ in range(3):
            status, headers, _ = router.post("/v1/completions", {"prompt": during, "max_tokens": 1})
            assert status == 200
            homes.add(headers["x-prefix-router-replica"])
            reasons.add(headers["x-prefix-router-reason"])
        assert len(homes) == 1 and "speculative_hit" in reasons
        ready = router.ready()
        assert ready["ready"] is True and all(r["routable"] for r in ready["replicas"])
        assert http("GET", router.url + "/ready")[0] == 200

        redis = RedisServer(port=redis.port).start()  # empty: no persistence
        wait_for(lambda: router.ready()["redis"]["connected"] is True, 30, message="reconnected")
        after = prompt()
        assert router.post("/v1/completions", {"prompt": after, "max_tokens": 1})[0] == 200
        # new KV events flow through the restarted Redis into the router's index again
        wait_for(lambda: confirmed_hit(after), 30, message="index resynced after the restart")
        assert all(r["routable"] for r in router.ready()["replicas"])
        assert prometheus_value(router.metrics(), "router_redis_resyncs_total") >= 2
    finally:
        if router is not None:
            print(router.stop()[-3000:])
        for proc in reversed(procs):
            stop_process(proc)
        redis.stop()


def test_stream_trimmed_past_the_router_forces_a_resync(tmp_path: Path) -> None:
    import redis as redis_lib

    from loadtest.harness.redis_server import RedisServer
    from router.shared import contract as c

    with RedisServer() as server:
        client = redis_lib.Redis.from_url(server.url)
        feed = ReplicaFeed(client)
        feed.heartbeat()
        feed.stored([1])
        router = Router(tmp_path, ["--redis-url", server.url])
        try:
            wait_for(lambda: router.ready()["replicas"], 15, message="replica seen")
            feed.stored([2])
            wait_for(lambda: router.ready()["index_blocks"] == 1 or
                     prometheus_value(router.metrics(), "router_events_total") >= 1, 15)
            assert prometheus_value(router.metrics(), "router_event_stream_gaps_total") == 0
            router.proc.send_signal(signal.SIGSTOP)  # the router falls behind ...
            try:
                # ... by more than one read batch (1,000 entries: only then can trimming, far
                # above that in the contract, have dropped unread entries) ...
                pipe = client.pipeline(transaction=False)
                for key in range(100, 1600):
                    feed.stored([key], pipe)
                pipe.execute()
                feed.heartbeat()
                # ... and the stream is trimmed past it
                client.xtrim(c.events_key("pr"), maxlen=1100, approximate=False)
            finally:
                router.proc.send_signal(signal.SIGCONT)
            wait_for(lambda: prometheus_value(router.metrics(),
                                              "router_event_stream_gaps_total") == 1, 15,
                     message="gap detected")
            wait_for(lambda: prometheus_value(router.metrics(), "router_redis_resyncs_total") >= 2,
                     15, message="full resync")
        finally:
            print(router.stop()[-3000:])
            client.close()
