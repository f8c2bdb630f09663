"""Router overhead: added latency and requests per second per core, router vs straight to the replica.

``python -m loadtest.bench.router [--requests 60] [--time-scale 1000]`` starts one emulated replica
(fast clock so the replica is not the bottleneck) and a router in front of it (static replica,
Qwen3 tokenizer), then for 1k, 8k and 32k-token prompts, as token ids and as text, sends the same
sequence of non-streamed requests (max_tokens=1) once directly and once through the router and
reports p50/p99 latency of both and the difference. Text prompts come in two kinds: ``text-cold``
(every prompt new: full tokenization) and ``text-shared`` (a shared document plus a new question:
the router's chain cache serves the shared part). Throughput per core: a concurrent burst through
the router, divided by the router process's CPU seconds (from /proc). Figures, not pass/fail.

``--upstream null`` puts a minimal replica behind the router instead of the emulator (it answers
a fixed completion at once without tokenizing or hashing), so the figures are the router's own
cost even where the emulator would saturate this machine's cores; ``--rate R`` switches to open
loop: requests start on a Poisson schedule of R per second whatever
the previous ones are doing; every prompt is sent once through the router and once directly, half
an interval apart (alternating which goes first, so neither always finds the replica's cache
warm); reported: p50/p99 of both, their differences (added latency), and the router's CPU time
per routed request. ``--sizes`` and ``--kinds`` pick the configurations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.harness.orphans import DIE_WITH_PARENT
from loadtest.harness.processes import (
    EMULATE,
    PYTHON,
    cpu_seconds,
    start_process,
    stop_processes,
    wait_ready,
)
from router.request.prompts import default_tokenizer_dir


def _start(args: list[str], log: Path) -> Any:
    """A benchmark's process (``python -m`` ``args``), ended by the kernel with the benchmark
    (a killed benchmark left its router and null replica running)."""
    return start_process([PYTHON, "-m", *args] if args[0] != PYTHON else args, log_path=log,
                         preexec_fn=DIE_WITH_PARENT)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_prompts(kind: str, num_tokens: int, count: int, tok: Any, rng: random.Random) -> list[Any]:
    if kind == "ids":
        return [[rng.randrange(1000, 100_000) for _ in range(num_tokens)] for _ in range(count)]

    def words(n_tokens: int) -> str:
        lines = []
        n = 0
        while n < n_tokens:
            line = " ".join(f"w{rng.randrange(10**5)}" for _ in range(12))
            lines.append(line)
            n += len(tok.encode(line + "\n", add_special_tokens=False))
        return "\n".join(lines) + "\n"

    if kind == "text-cold":
        return [words(num_tokens) for _ in range(count)]
    shared = words(num_tokens - 64)
    return [shared + f"Question {i}: " + words(48) for i in range(count)]


_BODIES: dict[int, bytes] = {}  # {id(prompt): encoded request body}; prompts live for the run
_JSON_HEADERS = {"Content-Type": "application/json"}


async def _timed(session: aiohttp.ClientSession, url: str, prompt: Any) -> float:
    body = _BODIES.get(id(prompt))
    if body is None:  # encode once: the client must not be the bottleneck at high rates
        body = _BODIES[id(prompt)] = json.dumps(
            {"model": "emulated-llm", "prompt": prompt, "max_tokens": 1}).encode()
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", data=body, headers=_JSON_HEADERS) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
    return time.perf_counter() - start


async def open_loop(session: aiohttp.ClientSession, router_url: str, replica_url: str,
                    prompts: list[Any], rate: float, rng: random.Random,
                    router_pid: int) -> tuple[list[float], list[float], float]:
    """Poisson arrivals at ``rate``/s; each prompt routed and direct. Returns latencies, CPU s."""
    loop = asyncio.get_running_loop()
    direct: list[float] = []
    routed: list[float] = []
    tasks = []

    failed: list[str] = []

    async def one(url: str, p: Any, out: list[float], at: float) -> None:
        delay = at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            out.append(await _timed(session, url, p))
        except (RuntimeError, aiohttp.ClientError) as exc:
            failed.append(f"{'router' if url == router_url else 'direct'}: {exc}")

    start = loop.time() + 0.05
    at = start
    for i, p in enumerate(prompts):
        first, second = ((router_url, routed), (replica_url, direct))[:: 1 if i % 2 == 0 else -1]
        tasks.append(asyncio.create_task(one(first[0], p, first[1], at)))
        tasks.append(asyncio.create_task(one(second[0], p, second[1], at + 0.5 / rate)))
        at += rng.expovariate(rate)
    cpu0 = cpu_seconds(router_pid)
    await asyncio.gather(*tasks)
    if failed:
        print(f"  {len(failed)} requests failed (excluded), e.g. {failed[0]}")
    return direct, routed, cpu_seconds(router_pid) - cpu0


_NULL_COMPLETION = json.dumps({
    "id": "cmpl-null", "object": "text_completion", "created": 0, "model": "emulated-llm",
    "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 0, "completion_tokens": 1, "total_tokens": 1}}).encode()


def _write_ready(ready_file: str, url: str) -> None:
    Path(ready_file + ".tmp").write_text(json.dumps({"replicas": [{"index": 0, "url": url}]}))
    os.replace(ready_file + ".tmp", ready_file)


def serve_null_replica(ready_file: str) -> None:
    """A replica that answers every completion at once (reads the body, tokenizes nothing)."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=_NULL_COMPLETION, content_type="application/json")

    serve_scripted_replica(ready_file, completions, "emulated-llm")


def serve_scripted_replica(ready_file: str, completions: Any, model: str) -> None:
    """Serve ``completions`` (an aiohttp handler) at /v1/completions on 127.0.0.1, port 0, with
    /health and /v1/models listing ``model``; write the URL to ``ready_file`` as the emulator
    does; serve until killed."""
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": "vllm", "root": model,
             "parent": None}]})

    async def main() -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        _write_ready(ready_file, f"http://127.0.0.1:{runner.addresses[0][1]}")
        await asyncio.Event().wait()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())


async def run(args: argparse.Namespace) -> None:
    """Start the replica (the emulator or the null replica) and a router in front of it, then
    print the added latency (open loop with ``--rate``, else sequential and the throughput per
    router core)."""
    tmp = Path(tempfile.mkdtemp(prefix="bench_router_"))
    tokenizer_dir = default_tokenizer_dir()
    if args.upstream == "null":
        emulator = _start(["loadtest.bench.router", "--serve-null", str(tmp / "emu.json")],
                          tmp / "emu.log")
    else:
        emulator = _start([*EMULATE, "--replicas", "1", "--time-scale", str(args.time_scale),
                           "--num-gpu-blocks-override", "20000", "--ready-file",
                           str(tmp / "emu.json")], tmp / "emu.log")
    router = None
    try:
        replica_url = wait_ready(tmp / "emu.json", [emulator], 60)["replicas"][0]["url"]
        router = _start(["router.cli", "serve", "--port", "0", "--replica", replica_url,
                         "--tokenizer", str(tokenizer_dir), "--ready-file", str(tmp / "router.json"),
                         "--log-level", "warning"], tmp / "router.log")
        router_url = wait_ready(tmp / "router.json", [router], 60)["url"]
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        rng = random.Random(0)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            if args.rate:
                await _open_loop_table(session, router_url, replica_url, router.pid, args, tok,
                                       rng)
                return
            await _sequential_table(session, router_url, replica_url, args, tok, rng)
            await _throughput(session, router_url, router.pid, args, tok, rng)
    finally:
        stop_processes([p for p in (emulator, router) if p is not None])


async def _open_loop_table(session: aiohttp.ClientSession, router_url: str, replica_url: str,
                           router_pid: int, args: argparse.Namespace, tok: Any,
                           rng: random.Random) -> None:
    """Per prompt size and kind, ``args.rate`` routed requests per second (and as many direct):
    the latency direct, routed and added, and the router's CPU per request."""
    print(f"open loop, {args.rate:g} routed req/s (+ the same direct), "
          f"{args.requests} requests per configuration, upstream {args.upstream}")
    print(f"{'prompt':>16} {'direct p50':>10} {'p99':>8} {'router p50':>10} {'p99':>8} "
          f"{'added p50':>9} {'added p99':>9} {'router CPU/req':>14}  (ms)")
    for num_tokens in [int(x) for x in args.sizes.split(",")]:
        for kind in args.kinds.split(","):
            prompts = make_prompts(kind, num_tokens, args.requests, tok, rng)
            for p in prompts[:2]:
                await _timed(session, router_url, p)
            direct, routed, cpu = await open_loop(
                session, router_url, replica_url, prompts[2:], args.rate, rng, router_pid)
            print(f"{kind + ' ' + str(num_tokens // 1024) + 'k':>16} "
                  f"{_pct(direct, .5) * 1e3:10.2f} {_pct(direct, .99) * 1e3:8.2f} "
                  f"{_pct(routed, .5) * 1e3:10.2f} {_pct(routed, .99) * 1e3:8.2f} "
                  f"{(_pct(routed, .5) - _pct(direct, .5)) * 1e3:9.2f} "
                  f"{(_pct(routed, .99) - _pct(direct, .99)) * 1e3:9.2f} "
                  f"{cpu * 1e3 / len(routed):14.2f}")


async def _sequential_table(session: aiohttp.ClientSession, router_url: str, replica_url: str,
                            args: argparse.Namespace, tok: Any, rng: random.Random) -> None:
    """Per prompt size and kind, one request at a time, each prompt direct and routed in turn:
    the latency direct, routed and added."""
    print(f"{'prompt':>16} {'direct p50':>10} {'p99':>8} {'router p50':>10} {'p99':>8} "
          f"{'added p50':>9} {'added p99':>9}  (ms)")
    for num_tokens in [int(x) for x in args.sizes.split(",")]:
        count = max(10, args.requests * 1024 // num_tokens) if num_tokens > 8192 else args.requests
        for kind in args.kinds.split(","):
            prompts = make_prompts(kind, num_tokens, count, tok, rng)
            # both paths see the same prompts; the replica caches them after the first
            # pass, so warm it first and send each prompt direct and routed alternately
            for p in prompts[:2]:
                await _timed(session, replica_url, p)
            direct, routed = [], []
            for p in prompts:
                routed.append(await _timed(session, router_url, p))
                direct.append(await _timed(session, replica_url, p))
            added = [r - d for r, d in zip(routed, direct, strict=True)]
            print(f"{kind + ' ' + str(num_tokens // 1024) + 'k':>16} "
                  f"{_pct(direct, .5) * 1e3:10.2f} {_pct(direct, .99) * 1e3:8.2f} "
                  f"{_pct(routed, .5) * 1e3:10.2f} {_pct(routed, .99) * 1e3:8.2f} "
                  f"{statistics.median(added) * 1e3:9.2f} {_pct(added, .99) * 1e3:9.2f}")


async def _throughput(session: aiohttp.ClientSession, router_url: str, router_pid: int,
                      args: argparse.Namespace, tok: Any, rng: random.Random) -> None:
    """Throughput per router core: concurrent token-id and shared-text 8k prompts."""
    for kind in ("ids", "text-shared"):
        prompts = make_prompts(kind, 8192, args.requests * 2, tok, rng)
        cpu0 = cpu_seconds(router_pid)
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(16)

        async def one(p: Any, sem: asyncio.Semaphore = sem) -> float:
            async with sem:
                return await _timed(session, router_url, p)

        await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(router_pid) - cpu0
        print(f"throughput {kind} 8k: {len(prompts) / wall:.0f} req/s wall "
              f"(replica-bound), router CPU {cpu * 1e3 / len(prompts):.2f} ms/request "
              f"= {len(prompts) / cpu:.0f} req/s per router core")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=60, help="requests per configuration")
    parser.add_argument("--time-scale", type=float, default=1000.0,
                        help="emulator clock speed-up (the replica should not be the bottleneck)")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="open loop: routed requests per second (Poisson); 0 = sequential")
    parser.add_argument("--sizes", default="1024,8192,32768", help="prompt lengths in tokens")
    parser.add_argument("--kinds", default="ids,text-cold,text-shared",
                        help="prompt kinds: ids, text-cold, text-shared")
    parser.add_argument("--upstream", choices=("emulator", "null"), default="emulator",
                        help="replica behind the router: the emulator, or a null replica that "
                             "answers at once (measures the router alone)")
    parser.add_argument("--serve-null", metavar="READY_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_null:
        serve_null_replica(args.serve_null)
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
