"""Data-parallel engines end to end: one emulator replica with ``--data-parallel-size 2`` (two
engine cores behind one URL, each with its own block pool and KV event stream), its worker
discovering both streams from ``GET /kv_event_sources``, a real Redis and a router. Every
process is real, on loopback."""

from __future__ import annotations

import json
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
import zmq

from router.shared import contract
from router.shared.kv_events import BlockStored, decode_batch
from tests.helpers import EMULATE, PYTHON, free_port_run, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import Router
from tests.integration.test_worker_emulator import (
    KV_EVENTS,
    SEED,
    procs,  # noqa: F401  (fixture)
    prompt,
    router_keys,
    tmp,  # noqa: F401  (fixture)
)

pytestmark = pytest.mark.timeout(150)

ENGINE = "engine-a"
RANKS = (f"{ENGINE}#0", f"{ENGINE}#1")
BLOCK = 16


def start_dp_emulator(where: Path, started: list[subprocess.Popen[bytes]],
                      ports: tuple[int, int] = (0, 0)) -> dict[str, Any]:
    """An emulator replica with two DP ranks, rank r's event and replay ports at ``ports`` + r
    (0: ephemeral); its ready-file entry."""
    ready = where / f"dp-ready-{random.random()}.json"
    config = dict(KV_EVENTS, endpoint=f"tcp://*:{ports[0]}", replay_endpoint=f"tcp://*:{ports[1]}")
    proc = start_process([*EMULATE, "--port", "0", "--ready-file", str(ready),
                          "--data-parallel-size", "2", "--num-gpu-blocks-override", "400",
                          "--enable-prompt-tokens-details",
                          "--kv-events-config", json.dumps(config)], env={"PYTHONHASHSEED": SEED})
    started.append(proc)
    wait_for(lambda: ready.exists() or proc.poll() is not None, 60, message="emulator ready")
    if proc.poll() is not None:
        raise RuntimeError(stop_process(proc))
    replica: dict[str, Any] = json.loads(ready.read_text())["replicas"][0]
    return replica


def start_dp_emulator_on_fixed_ports(where: Path, started: list[subprocess.Popen[bytes]],
                                     ) -> tuple[dict[str, Any], tuple[int, int]]:
    """``start_dp_emulator`` on given ports: events at P, P + 1 and replay at P + 2, P + 3, all
    four free a moment before (``free_port_run``); another run of ports if one was taken in
    between (the emulator exits naming ``Address already in use``), 3 tries at most."""
    for attempt in range(3):
        base = free_port_run(4)
        try:
            return start_dp_emulator(where, started, (base, base + 2)), (base, base + 2)
        except RuntimeError as exc:
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def engine_metric(url: str, name: str, rank: int) -> float:
    """Sum of the series of ``name`` labelled ``engine="<rank>"`` on the engine's page."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'engine="{rank}"' in line)


def test_the_emulator_fronts_two_ranks_as_vllm_does(
        tmp: Path, procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    replica = start_dp_emulator(tmp, procs)
    url = replica["url"]
    sources = requests.get(f"{url}/kv_event_sources", timeout=10).json()
    assert [s["data_parallel_rank"] for s in sources] == [0, 1]
    assert sources[0]["endpoint"] != sources[1]["endpoint"]
    ctx = zmq.Context()
    subs = []
    for source in sources:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 5000)
        sub.connect(source["endpoint"])
        subs.append(sub)
    try:
        def rank_1_published() -> bool:
            # each try a new prompt: the PUB socket drops what it sends before the
            # subscription arrives (slow joiner), and a cached prompt stores nothing new
            tokens[:] = prompt(2 * BLOCK + 3, rng)
            reply = requests.post(f"{url}/v1/completions", timeout=30,
                                  headers={"X-data-parallel-rank": "1"},
                                  json={"model": "emulated-llm", "prompt": tokens, "max_tokens": 1})
            assert reply.status_code == 200, reply.text
            return bool(subs[1].poll(500))

        rng = random.Random(1)
        tokens: list[int] = []
        wait_for(rank_1_published, 20, message="rank 1's stream")
        batch = decode_batch(subs[1].recv_multipart()[2])
        assert batch.data_parallel_rank == 1
        assert any(isinstance(e, BlockStored) for e in batch.events)
        assert not subs[0].poll(300), "rank 0 published events of a request it did not run"
        assert engine_metric(url, "vllm:prompt_tokens_total", 1) > 0
        assert engine_metric(url, "vllm:prompt_tokens_total", 0) == 0
        # without the header: vLLM's own balancing (lowest waiting * 4 + running) spreads
        # concurrent requests over both ranks
        before = [engine_metric(url, "vllm:request_success_total", rank) for rank in (0, 1)]
        bodies = [{"model": "emulated-llm", "prompt": prompt(8 * BLOCK, rng), "max_tokens": 4}
                  for _ in range(6)]
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda body: requests.post(
                f"{url}/v1/completions", json=body, timeout=30).status_code, bodies))
        assert replies == [200] * 6
        after = [engine_metric(url, "vllm:request_success_total", rank) for rank in (0, 1)]
        assert after[0] > before[0] and after[1] > before[1], (before, after)
        assert sum(after) - sum(before) == 6
        bad = requests.post(f"{url}/v1/completions", timeout=30,
                            headers={"X-data-parallel-rank": "2"},
                            json={"model": "emulated-llm", "prompt": tokens, "max_tokens": 1})
        assert bad.status_code == 400
        assert "out of range" in bad.json()["error"]["message"]
    finally:
        for sub in subs:
            sub.close(linger=0)
        ctx.term()


def heartbeat(client: redis.Redis, replica_id: str) -> dict[str, str]:
    raw: Any = client.hgetall(contract.replica_key("pr", replica_id))
    return {k.decode(): v.decode() for k, v in raw.items()}


def blocks(client: redis.Redis, replica_id: str) -> set[int]:
    members: Any = client.smembers(contract.blocks_key("pr", replica_id))
    return {contract.unpack_key(m) for m in members}


@pytest.mark.parametrize("sources", ["discovered", "configured"])
def test_a_dp2_engine_gets_requests_on_both_ranks_with_per_rank_hits(
        sources: str, tmp: Path, redis_url: str,  # noqa: F811
        procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    if sources == "discovered":  # ephemeral ports, read from GET /kv_event_sources
        replica = start_dp_emulator(tmp, procs)
        endpoints = ["--kv-events-endpoint", "auto"]
    else:  # rank 0's ports given, rank 1's derived (+1) as vLLM offsets them
        replica, ports = start_dp_emulator_on_fixed_ports(tmp, procs)
        endpoints = ["--kv-events-endpoint", f"tcp://127.0.0.1:{ports[0]}",
                     "--kv-replay-endpoint", f"tcp://127.0.0.1:{ports[1]}",
                     "--data-parallel-size", "2"]
    url = replica["url"]
    procs.append(start_process([
        PYTHON, "-m", "worker.cli", "report", "--engine-url", url, *endpoints,
        "--redis-url", redis_url, "--replica-id", ENGINE, "--hash-seed", SEED,
        "--index-stride", "1", "--log-level", "debug"]))
    # one routing target per rank: its own heartbeat (engine URL + rank), verified by a probe
    # sent to that rank
    wait_for(lambda: all(heartbeat(client, r).get(contract.F_HASH_VERIFIED) == "1"
                         for r in RANKS), 40, message="both ranks verified")
    for rank, rid in enumerate(RANKS):
        beat = heartbeat(client, rid)
        assert beat[contract.F_URL] == url
        assert beat[contract.F_DP_RANK] == str(rank)
    router = Router(tmp, ["--redis-url", redis_url, "--hash-seed", SEED, "--index-stride", "1"])
    procs.append(router.proc)
    wait_for(lambda: len([r for r in router.ready().get("replicas", []) if r["routable"]]) == 2,
             30, message="router sees both ranks")
    assert {r["replica_id"]: r["dp_rank"] for r in router.ready()["replicas"]} == {
        RANKS[0]: 0, RANKS[1]: 1}

    rng = random.Random(3)
    placed: dict[str, list[list[int]]] = {rid: [] for rid in RANKS}
    before = [engine_metric(url, "vllm:request_success_total", rank) for rank in (0, 1)]

    def send(tokens: list[int], **kw: Any) -> tuple[str, dict[str, Any]]:
        status, headers, body = router.post("/v1/completions", {
            "model": "emulated-llm", "prompt": tokens, "max_tokens": 1}, **kw)
        assert status == 200, body
        return headers["x-prefix-router-replica"], json.loads(body)

    for _ in range(12):
        tokens = prompt(4 * BLOCK, rng)
        rid, _ = send(tokens)
        placed[rid].append(tokens)
    assert all(placed[rid] for rid in RANKS), {r: len(p) for r, p in placed.items()}
    # each request ran on the rank the router chose (the engine's own per-rank counters)
    for rank, rid in enumerate(RANKS):
        wait_for(lambda rank=rank, rid=rid: engine_metric(
            url, "vllm:request_success_total", rank) - before[rank] == len(placed[rid]),
            10, message=f"rank {rank}'s request count")
    # a rank's blocks are in its own set only: rank 1's events never count for rank 0
    for rid, other in (RANKS, RANKS[::-1]):
        for tokens in placed[rid]:
            keys = set(router_keys(tokens))
            wait_for(lambda keys=keys, rid=rid: keys <= blocks(client, rid), 20,
                     message=f"{rid}'s keys")
            assert not keys & blocks(client, other)
    # a repeated prefix goes back to the rank holding it, and that rank's engine hits it
    for rid in RANKS:
        tokens = placed[rid][0]
        route = json.loads(router.post("/debug/route", {"prompt": [*tokens, 7, 7]})[2])
        assert route["replica"] == rid
        assert route["targets"][rid] == {"url": url, "dp_rank": RANKS.index(rid)}
        # a client's own rank header does not override the router's choice
        other = str(1 - RANKS.index(rid))
        got, reply = send([*tokens, 7, 7], headers={"X-data-parallel-rank": other})
        assert got == rid
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK
    # each rank's heartbeat carries that rank's load, not the engine's sum
    for rank, rid in enumerate(RANKS):
        wait_for(lambda rank=rank, rid=rid: float(heartbeat(client, rid)[
            contract.F_PREFIX_CACHE_QUERIES]) == engine_metric(
            url, "vllm:prefix_cache_queries_total", rank) > 0, 10,
            message=f"rank {rank}'s prefix-cache counters in its heartbeat")
    info = router.metrics()
    for rank, rid in enumerate(RANKS):
        assert (f'router_replica_info{{dp_rank="{rank}",replica="{rid}",url="{url}"}} 1.0'
                in info)
    client.close()


def test_static_replicas_name_one_rank_each(
        tmp: Path, procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    """Without workers or Redis: ``--replica URL#RANK`` makes each rank of a DP=2 engine a
    static routing target of its own (id ``host:port#RANK``), sent to with vLLM's
    ``X-data-parallel-rank`` header, and each request runs on the rank the router chose."""
    replica = start_dp_emulator(tmp, procs)
    url = replica["url"]
    ids = [f"127.0.0.1:{url.rsplit(':', 1)[1]}#{rank}" for rank in (0, 1)]
    router = Router(tmp, ["--replica", f"{url}#0", "--replica", f"{url}/#1",
                          "--policy", "round_robin"])
    procs.append(router.proc)
    wait_for(lambda: len([r for r in router.ready().get("replicas", []) if r["routable"]]) == 2,
             30, message="router probed both ranks")
    assert {r["replica_id"]: r["dp_rank"] for r in router.ready()["replicas"]} == {
        ids[0]: 0, ids[1]: 1}
    before = [engine_metric(url, "vllm:request_success_total", rank) for rank in (0, 1)]
    rng = random.Random(9)
    chosen = []
    for _ in range(6):
        # a client's own rank header is dropped: the router picks the rank
        status, headers, body = router.post("/v1/completions", {
            "model": "emulated-llm", "prompt": prompt(3 * BLOCK, rng), "max_tokens": 1},
            headers={"X-data-parallel-rank": "1"})
        assert status == 200, body
        chosen.append(headers["x-prefix-router-replica"])
    assert sorted(set(chosen)) == ids
    for rank, rid in enumerate(ids):
        wait_for(lambda rank=rank, rid=rid: engine_metric(
            url, "vllm:request_success_total", rank) - before[rank] == chosen.count(rid),
            10, message=f"rank {rank}'s request count")
    route = json.loads(router.post("/debug/route", {"prompt": prompt(3 * BLOCK, rng)})[2])
    assert route["targets"] == {rid: {"url": url, "dp_rank": rank} for rank, rid in enumerate(ids)}


def test_a_static_rank_the_engine_does_not_have_is_not_routable(
        tmp: Path, procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    """``--replica URL#2`` against a DP=2 engine: the engine's /health passes, but its
    ``GET /kv_event_sources`` lists ranks 0 and 1 only, so the router keeps ``#2`` out of
    routing, says why in /ready and its log, and every request goes to rank 0 (without the
    check, half of them were the engine's 400 "data_parallel_rank 2 is out of range")."""
    replica = start_dp_emulator(tmp, procs)
    url = replica["url"]
    port = url.rsplit(":", 1)[1]
    router = Router(tmp, ["--replica", f"{url}#0", "--replica", f"{url}#2",
                          "--policy", "round_robin", "--static-probe-interval-s", "0.2"])
    procs.append(router.proc)
    wait_for(lambda: any(r["routable"] for r in router.ready().get("replicas", [])), 30,
             message="router probed rank 0")
    ready = {r["replica_id"]: r for r in router.ready()["replicas"]}
    assert ready[f"127.0.0.1:{port}#0"]["routable"]
    assert not ready[f"127.0.0.1:{port}#2"]["routable"]
    assert ready[f"127.0.0.1:{port}#2"]["not_routable_reason"] == (
        "data-parallel rank 2 is not one of the engine's ranks [0, 1] (GET /kv_event_sources)")
    rng = random.Random(4)
    for _ in range(6):
        status, headers, body = router.post("/v1/completions", {
            "model": "emulated-llm", "prompt": prompt(2 * BLOCK, rng), "max_tokens": 1})
        assert status == 200, body
        assert headers["x-prefix-router-replica"] == f"127.0.0.1:{port}#0"
    log = stop_process(router.proc)
    assert (f"static replica 127.0.0.1:{port}#2 is not routable: data-parallel rank 2 is not "
            "one of the engine's ranks [0, 1]") in log, log[-2000:]


def test_an_engine_that_lists_no_ranks_keeps_its_static_ranks_routable(
        tmp: Path, procs: list[subprocess.Popen[bytes]]) -> None:  # noqa: F811
    """KV events off: ``GET /kv_event_sources`` lists no rank, which says nothing about the
    engine's ranks, so the rank check leaves both static ranks routable."""
    ready = tmp / "dp-no-events.json"
    proc = start_process([*EMULATE, "--port", "0", "--ready-file", str(ready),
                          "--data-parallel-size", "2"])
    procs.append(proc)
    wait_for(lambda: ready.exists() or proc.poll() is not None, 60, message="emulator ready")
    url = json.loads(ready.read_text())["replicas"][0]["url"]
    assert requests.get(f"{url}/kv_event_sources", timeout=10).json() == []
    router = Router(tmp, ["--replica", f"{url}#0", "--replica", f"{url}#1",
                          "--static-probe-interval-s", "0.2"])
    procs.append(router.proc)
    wait_for(lambda: sum(r["routable"] for r in router.ready().get("replicas", [])) == 2, 30,
             message="both ranks routable")
    log = stop_process(router.proc)
    assert "not routable" not in log, log[-2000:]
