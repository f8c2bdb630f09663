"""A data-parallel engine routed per rank against vLLM's own DP balancing, side by side.

Each arm gets a fresh emulator replica with ``--data-parallel-size 2`` (two engine cores, each
its own KV block pool, behind one URL) and a router; the same workload goes through both:

* ``vllm_dp_balancing``: the router knows the engine as one static replica and sends no rank
  header, so the engine's own DP balancing (lowest ``waiting * 4 + running``) picks the rank;
* ``prefix_per_rank``: the engine's worker (``--kv-events-endpoint auto``) publishes each rank
  as a replica to Redis and the router sends each request to the rank it chose
  (``X-data-parallel-rank``).

The workload is ``families`` shared prefixes (a system prompt or document each), requested
``per_family`` times in interleaved rounds with distinct suffixes, ``concurrency`` requests in
flight. The per-rank pool is sized so one rank holds about half the families: a rank-blind
spread keeps copies of each family on both ranks and evicts. Reported per arm: the engines'
token hit rate (``vllm:prefix_cache_hits`` / ``queries`` over both ranks), the share of
requests on rank 0, and the client-side median latency; arms alternate order per repeat, and
the summary gives medians and ranges over the repeats. Does I/O (processes, HTTP).

    python -m loadtest.bench.data_parallel [--repeats 3] [--families 16] [--per-family 6]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
import requests

from loadtest.harness.processes import EMULATE, PYTHON, start_process, stop_process, wait_for
from loadtest.harness.redis_server import RedisServer

SEED = "0"  # PYTHONHASHSEED of the engine, --hash-seed of worker and router
ARMS = ("vllm_dp_balancing", "prefix_per_rank")
KV_EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
             "replay_endpoint": "tcp://*:0"}


def _ready_json(path: Path, proc: subprocess.Popen[bytes], what: str) -> dict[str, Any]:
    wait_for(lambda: path.exists() or proc.poll() is not None, 60, message=what)
    if proc.poll() is not None:
        raise RuntimeError(f"{what}: exited\n{stop_process(proc)[-3000:]}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _engine_counters(url: str) -> dict[str, list[float]]:
    """``{name: [rank 0, rank 1]}`` of the counters the bench reads."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    out: dict[str, list[float]] = {}
    for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
                 "vllm:request_success_total"):
        out[name] = [sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith(name + "{") and f'engine="{rank}"' in line)
                     for rank in (0, 1)]
    return out


def workload(families: int, per_family: int, prefix_tokens: int, suffix_tokens: int,
             seed: int) -> list[list[int]]:
    """Token-id prompts: ``per_family`` rounds over the families (shuffled per round)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, 20_000) for _ in range(prefix_tokens)] for _ in range(families)]
    prompts = []
    for _ in range(per_family):
        order = list(range(families))
        rng.shuffle(order)
        for family in order:
            prompts.append(prefixes[family] + [rng.randrange(100, 20_000)
                                               for _ in range(suffix_tokens)])
    return prompts


def run_arm(arm: str, prompts: list[list[int]], args: argparse.Namespace,
            redis_url: str) -> dict[str, float]:
    """One arm on a fresh emulator (two data-parallel ranks) and router: ``prompts`` sent
    ``args.concurrency`` at a time; the engine's hit rate, rank 0's share of the requests and
    the median latency."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        try:
            url, router_url = _start_arm(arm, args, redis_url, Path(tmp), procs)
            before = _engine_counters(url)

            def send(tokens: list[int]) -> float:
                start = time.perf_counter()
                resp = requests.post(f"{router_url}/v1/completions", timeout=120, json={
                    "model": "emulated-llm", "prompt": tokens, "max_tokens": args.max_tokens})
                resp.raise_for_status()
                return time.perf_counter() - start

            with ThreadPoolExecutor(args.concurrency) as pool:
                latencies = list(pool.map(send, prompts))
            after = _engine_counters(url)
        finally:
            for proc in reversed(procs):
                stop_process(proc)

    def delta(name: str) -> list[float]:
        return [a - b for a, b in zip(after[name], before[name], strict=True)]

    hits, queries = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
    done = delta("vllm:request_success_total")
    return {"hit_rate": sum(hits) / max(sum(queries), 1.0),
            "rank0_share": done[0] / max(sum(done), 1.0),
            "latency_p50_s": statistics.median(latencies)}


def _start_arm(arm: str, args: argparse.Namespace, redis_url: str, tmp: Path,
               procs: list[subprocess.Popen[bytes]]) -> tuple[str, str]:
    """Start the arm's emulator, its worker (the per-rank arm), and the router, appending each
    process to ``procs``; wait until the router can route to every rank. The engine's and the
    router's URLs."""
    ready = tmp / "emulator.json"
    emu = start_process([*EMULATE, "--ready-file", str(ready), "--data-parallel-size", "2",
                         "--num-gpu-blocks-override", str(args.num_gpu_blocks),
                         "--time-scale", str(args.time_scale), "--max-num-seqs", "16",
                         "--kv-events-config", json.dumps(KV_EVENTS)],
                        env={"PYTHONHASHSEED": SEED})
    procs.append(emu)
    url = _ready_json(ready, emu, "emulator")["replicas"][0]["url"]
    router_args = ["--hash-seed", SEED, "--model", "emulated-llm"]
    expected = 1
    if arm == "prefix_per_rank":
        client = redis.Redis.from_url(redis_url)
        client.flushall()  # the previous arm's replicas
        client.close()
        procs.append(start_process([
            PYTHON, "-m", "worker.cli", "report", "--engine-url", url,
            "--kv-events-endpoint", "auto", "--redis-url", redis_url,
            "--replica-id", "engine", "--hash-seed", SEED, "--log-level", "warning"]))
        router_args += ["--redis-url", redis_url]
        expected = 2
    else:
        router_args += ["--replica", url]
    router_ready = tmp / "router.json"
    router = start_process([PYTHON, "-m", "router.cli", "serve", "--port", "0",
                            "--ready-file", str(router_ready), "--log-level", "warning",
                            *router_args])
    procs.append(router)
    router_url = _ready_json(router_ready, router, "router")["url"]

    def routable() -> bool:
        body = requests.get(f"{router_url}/ready", timeout=5).json()
        return sum(1 for r in body.get("replicas", [])
                   if r["routable"] and (arm != "prefix_per_rank" or r["affinity"])) \
            == expected

    wait_for(routable, 60, message=f"{arm}: router ready")
    return url, router_url


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--families", type=int, default=16)
    parser.add_argument("--per-family", type=int, default=6)
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-gpu-blocks", type=int, default=600,
                        help="per rank; 16 families of 1024 tokens are 1024 blocks")
    parser.add_argument("--time-scale", type=float, default=10.0)
    args = parser.parse_args(argv)
    prompts = workload(args.families, args.per_family, args.prefix_tokens, args.suffix_tokens, 7)
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    with RedisServer() as redis_server:
        for repeat in range(args.repeats):
            for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
                result = run_arm(arm, prompts, args, redis_server.url)
                results[arm].append(result)
                print(f"repeat {repeat + 1} {arm:18s} " + " ".join(
                    f"{k}={v:.3f}" for k, v in result.items()), flush=True)
    print(f"\n{len(prompts)} requests, {args.families} families x {args.per_family}, "
          f"concurrency {args.concurrency}; median [min, max] over {args.repeats} repeats")
    for arm in ARMS:
        cells = []
        for key in ("hit_rate", "rank0_share", "latency_p50_s"):
            values = [r[key] for r in results[arm]]
            cells.append(f"{key} {statistics.median(values):.3f} "
                         f"[{min(values):.3f}, {max(values):.3f}]")
        print(f"{arm:18s} " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
