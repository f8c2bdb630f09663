"""Scale benchmark: the CPU one router process spends keeping its block index up to date, and the
requests per second one router core routes on top of that, for large fleets. Does I/O.

``python -m loadtest.bench.scale [--replicas 64,256] [--rates 1000,5000] [--strides 1,16]``

No engines and no workers: a writer process plays the whole fleet's workers, pouring synthetic
KV-change traffic shaped like the Mooncake conversation trace into a real Redis, in real time,
through the workers' own flush (``worker.flush_batch`` into ``worker.replica_store._FLUSH``: the
set updates, then one stream entry per flush, exactly what ``prefix-worker report`` writes). Per request, one replica
(uniformly at random) stores ``--blocks-per-request`` new 16-token blocks at chain depths
``[h, h + blocks)`` (``h`` uniform below ``--max-hit-blocks``, the prefix it already held) and
evicts as many, namely the blocks it stored ``--resident-requests`` requests earlier (before
that: keys it never stored); with ``index_stride`` N only the anchor positions of those depths
are written (``router.shared.contract.is_anchor``), as workers do. Heartbeats for every replica point at
one null replica (``loadtest.bench.router --serve-null``).

For every (replicas, rate, stride): a fresh Redis and router (``prefix-router serve
--index-stride N``), then

1. upkeep: ``--seconds`` of traffic; the router's CPU seconds per request written
   (``us/req``) times the target rate is the share of a core its upkeep needs (``upkeep``;
   extrapolated, marked ``*``, when the writer could not reach the target rate on this
   machine); the router must have read the stream to its end within 5 s after the writer
   stops, else it could not keep up (``caught up``: no);
2. routing on top: the same traffic again while a closed loop of ``--concurrency`` clients sends
   8k-token token-id completions through the router (one of 64 shared 7.5k-token documents
   plus a new 512-token question); with ``c`` = (CPU - upkeep) / requests, one core sustains
   ``(1 - upkeep cores) / c`` requests/s.

Reported per configuration: keys per second into Redis, the writer's achieved request rate
(below the target when this machine could not generate it), Redis CPU, router upkeep cores,
router CPU per routed request and requests/s per router core with upkeep. Figures, not pass/fail;
on a busy 2-core machine the writer, Redis, the null replica and the router share the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import random
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench.router import _start
from loadtest.harness.processes import cpu_seconds as _cpu_seconds
from loadtest.harness.processes import stop_process, wait_ready
from loadtest.harness.redis_server import RedisServer
from router.shared import contract as c
from router.shared.contract import OP_REMOVED, OP_STORED, BlockKey
from worker.flush_batch import flush_batch
from worker.replica_store import _FLUSH
from worker.replica_view import Change

MODEL = "emulated-llm"
TICK_S = 0.01  # the writer sends each 10 ms of traffic as one pipeline
DOCS = 64  # shared documents of the routed requests
DOC_TOKENS = 7680
QUESTION_TOKENS = 512


def _replica_ids(num: int) -> list[str]:
    return [f"replica-{i}" for i in range(num)]


def _heartbeat(client: Any, replica_ids: list[str], url: str, stride: int) -> None:
    pipe = client.pipeline(transaction=False)
    now = time.time()
    for rid in replica_ids:
        key = c.replica_key(c.DEFAULT_REDIS_PREFIX, rid)
        pipe.hset(key, mapping={
            c.F_REPLICA_ID: rid, c.F_URL: url, c.F_MODELS: f'["{MODEL}"]', c.F_BLOCK_SIZE: 16,
            c.F_HASH_ALGO: "sha256", c.F_HASH_VERIFIED: "1", c.F_KEY_MODE: "engine",
            c.F_CONTRACT: c.CONTRACT_VERSION, c.F_INDEX_STRIDE: stride, c.F_EPOCH: 1,
            c.F_SEQ: 0, c.F_NUM_GPU_BLOCKS: 32000, c.F_HEARTBEAT_TS: now})
        pipe.pexpire(key, int(c.HEARTBEAT_TTL_S * 1000))
    pipe.execute()


def pour(redis_url: str, replica_ids: list[str], url: str, rate: float, seconds: float,
         stride: int, blocks: int, max_hit: int, resident: int, seed: int, out: Any) -> None:
    """Writer process: ``rate`` requests/s of worker flushes for ``seconds``, heartbeats every
    second. Puts ``(requests written, keys written, wall seconds)`` on ``out``."""
    import redis

    client = redis.Redis.from_url(redis_url)
    script = client.register_script(_FLUSH)
    rng = random.Random(seed)
    history: dict[str, deque[list[BlockKey]]] = {rid: deque() for rid in replica_ids}
    entry_seq = dict.fromkeys(replica_ids, 0)  # {replica_id: last E_ENTRY_SEQ written}
    anchors_at = [sum(1 for d in range(h, h + blocks) if c.is_anchor(d, stride))
                  for h in range(max_hit)]
    state_ttl_ms = int(c.DEFAULT_STATE_TTL_S * 1000)

    def new_keys(num: int) -> list[BlockKey]:
        return [BlockKey(rng.getrandbits(64)) for _ in range(num)]

    keys_written = requests = 0
    start = time.monotonic()
    next_beat = start
    tick = 0
    while True:
        now = time.monotonic()
        if now - start >= seconds:
            break
        if now >= next_beat:
            _heartbeat(client, replica_ids, url, stride)
            next_beat += c.HEARTBEAT_INTERVAL_S
        tick += 1
        due = int(rate * min(tick * TICK_S, seconds)) - requests
        pipe = client.pipeline(transaction=False)
        for _ in range(due):
            rid = replica_ids[rng.randrange(len(replica_ids))]
            num = anchors_at[rng.randrange(max_hit)]
            stored = new_keys(num)
            past = history[rid]
            past.append(stored)
            removed = past.popleft() if len(past) > resident else new_keys(num)
            # the worker's own flush (ARGV and stream entry): one change of each kind, no
            # heartbeat re-created (the heartbeats above keep the hash)
            batch = flush_batch([Change(OP_REMOVED, removed, 1, 0), Change(OP_STORED, stored, 1, 0)],
                                (1, 0), entry_seq[rid], rid, state_ttl_ms, None)
            entry_seq[rid] = batch.entry_seq
            script(keys=[c.blocks_key(c.DEFAULT_REDIS_PREFIX, rid),
                         c.replica_key(c.DEFAULT_REDIS_PREFIX, rid),
                         c.blocks_key(c.DEFAULT_REDIS_PREFIX, rid, c.TIER_CPU)],
                   args=batch.args, client=pipe)
            if batch.entry is not None:
                pipe.xadd(c.events_key(c.DEFAULT_REDIS_PREFIX), batch.entry,
                          maxlen=c.EVENTS_STREAM_MAXLEN, approximate=True)
            keys_written += batch.num_keys
        requests += due
        if due:
            pipe.execute()
        sleep = start + tick * TICK_S - time.monotonic()
        if sleep > 0:
            time.sleep(sleep)
    out.put((requests, keys_written, time.monotonic() - start))
    client.close()


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    docs = [[rng.randrange(1000, 100_000) for _ in range(DOC_TOKENS)] for _ in range(DOCS)]
    return [docs[rng.randrange(DOCS)] + [rng.randrange(1000, 100_000)
                                         for _ in range(QUESTION_TOKENS)] for _ in range(count)]


async def _closed_loop(router_url: str, prompts: list[list[int]], seconds: float,
                       concurrency: int) -> int:
    """Send completions through the router for ``seconds``; returns how many completed."""
    done = 0
    deadline = time.monotonic() + seconds
    bodies = [msgspec_json(p) for p in prompts]

    async def client(session: aiohttp.ClientSession, offset: int) -> None:
        nonlocal done
        i = offset
        while time.monotonic() < deadline:
            async with session.post(router_url + "/v1/completions", data=bodies[i % len(bodies)],
                                    headers={"Content-Type": "application/json"}) as resp:
                await resp.read()
                if resp.status == 200:
                    done += 1
            i += concurrency

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session, k) for k in range(concurrency)))
    return done


def msgspec_json(prompt: list[int]) -> bytes:
    import msgspec

    return msgspec.json.encode({"model": MODEL, "prompt": prompt, "max_tokens": 1})


async def _stream_end(client: Any) -> str:
    last = await client.xrevrange(c.events_key(c.DEFAULT_REDIS_PREFIX), count=1)
    return last[0][0].decode() if last else "0-0"


async def _router_position(session: aiohttp.ClientSession, router_url: str) -> str:
    async with session.get(router_url + "/ready") as resp:
        body = await resp.json()
    return str((body.get("redis") or {}).get("last_stream_id", ""))


def _phase(args: argparse.Namespace, redis_url: str, ids: list[str], null_url: str,
           stride: int, rate: float, seed: int) -> tuple[Any, Any]:
    queue: Any = mp.get_context("spawn").Queue()
    proc = mp.get_context("spawn").Process(target=pour, args=(
        redis_url, ids, null_url, rate, args.seconds, stride, args.blocks_per_request,
        args.max_hit_blocks, args.resident_requests, seed, queue))
    proc.start()
    return proc, queue


def _writer_result(proc: Any, queue: Any) -> tuple[int, int, float]:
    """What the writer process put on ``queue``. Raises ``RuntimeError`` when it exited without
    (its traceback is on stderr): the bench used to wait for it forever."""
    import queue as queues

    while True:
        try:
            return queue.get(timeout=1.0)
        except queues.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the KV-change writer exited with status {proc.exitcode} "
                                   "before reporting (its error is above)") from None


@dataclass
class _Target:
    """One configuration's router and Redis, as a phase measures them."""

    router_url: str
    router_pid: int
    redis_url: str
    redis_pid: int
    client: Any  # redis.asyncio.Redis: reads the stream's end
    session: aiohttp.ClientSession


async def run_one(args: argparse.Namespace, tmp: Path, null_url: str, num_replicas: int,
                  rate: float, stride: int, prompts: list[list[int]]) -> dict[str, Any]:
    """One configuration: ``num_replicas`` made-up replicas (heartbeats in a fresh Redis, their
    KV changes poured by another process) behind a fresh router; the router's and Redis's CPU in
    an upkeep-only phase and in a routing phase, and what that makes per request and per core."""
    import redis.asyncio as aioredis

    ids = _replica_ids(num_replicas)
    with RedisServer() as server:
        import redis

        sync = redis.Redis.from_url(server.url)
        _heartbeat(sync, ids, null_url, stride)
        ready = tmp / f"router-{num_replicas}-{rate:g}-{stride}.json"
        router = _start(["router.cli", "serve", "--port", "0", "--redis-url", server.url,
                         "--index-stride", str(stride), "--model", MODEL, "--ready-file",
                         str(ready), "--log-level", "warning"], tmp / "router.log")
        client = aioredis.Redis.from_url(server.url)
        try:
            router_url = wait_ready(ready, [router], 60)["url"]
            async with aiohttp.ClientSession() as session:
                await _await_replicas_and_warm(session, router_url, num_replicas, prompts)
                target = _Target(router_url, router.pid, server.url, server.pid, client, session)
                result: dict[str, Any] = {"replicas": num_replicas, "rate": rate,
                                          "stride": stride}
                for phase in ("upkeep", "routing"):
                    seed = hash((num_replicas, rate, stride, phase)) & 0xFFFF
                    result[phase] = await _measure_phase(phase, target, args, ids, null_url,
                                                         stride, rate, prompts, seed)
                return _with_per_core_figures(result, rate)
        finally:
            await client.aclose()
            sync.close()
            stop_process(router)  # SIGKILL after 10 s: still busy applying a backlog


async def _await_replicas_and_warm(session: aiohttp.ClientSession, router_url: str,
                                   num_replicas: int, prompts: list[list[int]]) -> None:
    """Wait (up to 30 s) until the router lists every replica, then send it the documents so
    its chain cache is warm."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        async with session.get(router_url + "/ready") as resp:
            body = await resp.json()
        if len(body.get("replicas", ())) == num_replicas:
            break
        await asyncio.sleep(0.2)
    for p in prompts[:DOCS]:  # warm the chain cache with the documents
        async with session.post(router_url + "/v1/completions",
                                data=msgspec_json(p)) as resp:
            await resp.read()


async def _measure_phase(phase: str, target: _Target, args: argparse.Namespace, ids: list[str],
                         null_url: str, stride: int, rate: float, prompts: list[list[int]],
                         seed: int) -> dict[str, Any]:
    """One phase: the writer pours ``args.seconds`` of traffic (in the routing phase, requests
    are routed meanwhile); what it wrote, the CPU the router and Redis used, and how long the
    router took to catch up with the stream's end (inf after 5 s)."""
    cpu0, rcpu0 = _cpu_seconds(target.router_pid), _cpu_seconds(target.redis_pid)
    proc, queue = _phase(args, target.redis_url, ids, null_url, stride, rate, seed=seed)
    routed = 0
    if phase == "routing":
        await asyncio.sleep(0.3)  # the writer is up
        routed = await _closed_loop(target.router_url, prompts, args.seconds - 0.5,
                                    args.concurrency)
    requests, keys, wall = await asyncio.to_thread(_writer_result, proc, queue)
    proc.join()
    end = await _stream_end(target.client)
    caught_up = time.monotonic() + 5.0
    lag_s = 0.0
    t_end = time.monotonic()
    while await _router_position(target.session, target.router_url) != end:
        if time.monotonic() > caught_up:
            lag_s = float("inf")
            break
        await asyncio.sleep(0.02)
    else:
        lag_s = time.monotonic() - t_end
    cpu = _cpu_seconds(target.router_pid) - cpu0
    return {"requests_written": requests, "wall_s": round(wall, 2),
            "keys_per_s": round(keys / wall), "routed": routed,
            "router_cpu_s": round(cpu, 3),
            "redis_cpu_s": round(_cpu_seconds(target.redis_pid) - rcpu0, 3),
            "catch_up_s": lag_s}


def _with_per_core_figures(result: dict[str, Any], rate: float) -> dict[str, Any]:
    """``result`` with the upkeep's cost per request and in cores at ``rate``, the routing's CPU
    per request net of upkeep, and the requests per second one core routes."""
    up = result["upkeep"]
    # the router's cost per request of upkeep is ~constant once reads are batched, so
    # a rate this machine could not generate is extrapolated from the achieved one
    per_request_s = up["router_cpu_s"] / max(up["requests_written"], 1)
    upkeep_cores = per_request_s * rate
    ro = result["routing"]
    ro_upkeep_s = per_request_s * ro["requests_written"]
    per_req = ((ro["router_cpu_s"] - ro_upkeep_s) / ro["routed"]
               if ro["routed"] else float("nan"))
    result["upkeep_us_per_request"] = round(per_request_s * 1e6, 1)
    result["upkeep_cores"] = round(upkeep_cores, 3)
    result["extrapolated"] = up["requests_written"] < 0.95 * rate * up["wall_s"]
    result["route_cpu_ms"] = round(per_req * 1e3, 2)
    result["rps_per_core"] = (round((1 - upkeep_cores) / per_req)
                              if per_req > 0 and upkeep_cores < 1 else 0)
    return result


def _print(r: dict[str, Any]) -> None:
    up = r["upkeep"]
    achieved = up["requests_written"] / up["wall_s"]
    lag = "no" if up["catch_up_s"] == float("inf") else f"{up['catch_up_s']:.2f} s"
    cores = f"{r['upkeep_cores']:.3f}{'*' if r['extrapolated'] else ''}"
    print(f"{r['replicas']:>8} {r['rate']:>7g} {r['stride']:>6} {achieved:>9.0f} "
          f"{up['keys_per_s']:>10} {up['redis_cpu_s'] / up['wall_s']:>9.2f} "
          f"{r['upkeep_us_per_request']:>9.1f} {cores:>9} {lag:>9} {r['route_cpu_ms']:>9.2f} "
          f"{r['rps_per_core']:>9}", flush=True)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="bench_scale_"))
    null = _start(["loadtest.bench.router", "--serve-null", str(tmp / "null.json")],
                  tmp / "null.log")
    results = []
    try:
        null_url = wait_ready(tmp / "null.json", [null], 60)["replicas"][0]["url"]
        prompts = _prompts(random.Random(0), 4 * DOCS)
        print(f"{args.seconds:g} s of traffic per phase, {args.blocks_per_request} blocks stored "
              f"and evicted per request; router upkeep measured alone, then with "
              f"{args.concurrency} closed-loop clients of 8k-token id prompts")
        print(f"{'replicas':>8} {'req/s':>7} {'stride':>6} {'achieved':>9} {'keys/s':>10} "
              f"{'redis cpu':>9} {'us/req':>9} {'upkeep':>9} {'caught up':>9} {'ms/req':>9} "
              f"{'req/s/core':>9}")
        print("(upkeep: router cores at the target rate, * = extrapolated from the achieved rate; "
              "ms/req: routing CPU per request on top of upkeep)")
        for num in (int(x) for x in args.replicas.split(",")):
            for rate in (float(x) for x in args.rates.split(",")):
                for stride in (int(x) for x in args.strides.split(",")):
                    result = await run_one(args, tmp, null_url, num, rate, stride, prompts)
                    results.append(result)
                    _print(result)
    finally:
        stop_process(null)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="64,256", help="fleet sizes")
    parser.add_argument("--rates", default="1000,5000", help="fleet-wide requests per second")
    parser.add_argument("--strides", default=f"1,{c.DEFAULT_INDEX_STRIDE}",
                        help="index strides to compare (1 = exact index)")
    parser.add_argument("--seconds", type=float, default=5.0, help="traffic per phase")
    parser.add_argument("--blocks-per-request", type=int, default=500,
                        help="16-token blocks stored (and evicted) per request (Mooncake: ~500)")
    parser.add_argument("--max-hit-blocks", type=int, default=256,
                        help="a request's stored blocks start at a depth uniform below this")
    parser.add_argument("--resident-requests", type=int, default=8,
                        help="a replica evicts what it stored this many requests earlier")
    parser.add_argument("--concurrency", type=int, default=4, help="closed-loop routing clients")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    results = asyncio.run(run(args))
    if args.json is not None:
        import json

        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
