"""The router's CPU budget per request, by phase, against a scripted upstream (issue 32).

``python -m loadtest.bench.request_cpu [--requests 1500] [--concurrency 16] [--chunks 13]
[--profile] [--router-dir DIR]``

Starts a scripted replica (this module with ``--serve``: an aiohttp server that reads the body
and streams ``--chunks`` SSE events, the last one with usage, then ``[DONE]``, each in its own
write and TCP segment) and the real router in front of it (static replica, the Qwen3
tokenizer), then sends the demo's request shape through the router: new 8k token-id prompts
(a ~50 KB JSON body), ``stream: true`` with usage, ``--concurrency`` at once. Reported: the
router process's CPU milliseconds per request (user + system from /proc over the measured
requests, after a warm-up), the part of it on the event loop's thread, wall requests per second,
and how many requests the template audit observed and dropped.

``--profile`` also samples the router's Python stacks with py-spy (``pip install py-spy``;
``--rate`` samples per second, idle samples excluded) while the requests run, and splits the
router's CPU per request into phases by the innermost stack frame each sample is in
(``PHASES``: accept and body read, middlewares, parse, prompt chain, decision, dispatch
bookkeeping, upstream connect and send, relay, completion bookkeeping, metrics, socket
writes, the rest): each phase's share of the samples times the CPU per request (``--cpu-ms``:
one measured without the profiler). py-spy samples wall time in which a thread runs or waits
to run, so on a busy machine a phase of system calls (socket writes, ``os.urandom``) weighs
more than its CPU: shares, not exact microseconds.

``--router-dir`` runs the router from another checkout (its code, this interpreter): an A/B of
two commits, run in turn (``benchmarks.md``). Figures, not pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

import aiohttp
from aiohttp import web

from loadtest.bench.router import serve_scripted_replica
from loadtest.harness.processes import (
    PYTHON,
    cpu_seconds,
    start_process,
    stop_processes,
    wait_ready,
)
from router.request.prompts import default_tokenizer_dir

MODEL: Final = "emulated-llm"
PROMPT_TOKENS: Final = 8192  # the demo's long prompts, as token ids
CHUNK_GAP_S: Final = 0.0005  # between two SSE events: each one is its own read in the router

# (phase, the frames that put a sample in it: "file:function", or "file:" for any function of
# a module). A sample goes to the phase of its innermost frame that matches, phases tried in
# this order for each frame: so the prefill-rate fit a finished request teaches
# (``ttft.py``, matching nothing) counts under ``learning.py``, and a metric observed
# anywhere counts as metrics. Samples in an idle thread-pool worker (waiting for work: py-spy
# can take that wait for activity) are left out; the event loop's own C code shows as "other".
PHASES: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("metrics", ("prometheus_client/",)),
    # aiohttp's writes to the client's and the replica's sockets (send syscalls)
    ("socket writes", ("http_writer.py:",)),
    ("completion bookkeeping", ("learning.py:", "audit_queue.py:", "audit.py:",
                                "usage.py:cached_tokens",
                                "usage.py:completion_tokens", "routing.py:served",
                                "server.py:_remember_response")),
    # (a tree before the proxy's split: ``proxy.py:_relay``, the answer's head in ``_attempt``)
    ("relay", ("relay.py:_stream", "relay.py:_stream_failed", "proxy.py:_relay",
               "usage.py:joined_tail", "usage.py:trim_tail", "usage.py:keep_tail")),
    ("upstream connect + send", ("proxy.py:_attempt", "proxy.py:_traced_attempt",
                                 "proxy.py:answer_headers", "relay.py:answer",
                                 "first_byte_waits.py:")),
    ("dispatch bookkeeping", ("dispatch.py:", "health.py:", "load.py:", "proxy.py:forward",
                              "proxy.py:_answered", "server.py:_admit", "rate_limits.py:", "admission.py:",
                              "gate.py:", "fleet.py:mark_failed")),
    ("prompt chain", ("prompt_path.py:", "chain_cache.py:", "hashing.py:", "lru.py:",
                      "prompts.py:chain")),
    ("decision", ("routing.py:", "policy.py:", "index.py:", "ring.py:", "fleet.py:",
                  "speculative.py:", "sessions.py:")),
    ("parse", ("server.py:_parse", "server.py:_aliased", "server.py:_request_template",
               "prompts.py:", "apis/")),
    ("accept + body read", ("server.py:_read_body", "web_protocol.py:data_received",
                            "web_protocol.py:connection_made", "streams.py:",
                            "web_request.py:read")),
    ("middlewares + request id", ("server.py:_request_id_middleware", "http_errors.py:",
                                  "auth.py:", "web_middlewares.py:")),
)
IDLE_FRAME: Final = "_worker (concurrent/futures/thread.py"  # a pool thread waiting for work


def _sse_events(chunks: int) -> list[bytes]:
    events = [b'data: {"id":"cmpl-b","object":"text_completion","created":0,"model":"'
              + MODEL.encode() + b'","choices":[{"index":0,"text":" tok%d","logprobs":null,'
              b'"finish_reason":null}],"usage":null}\n\n' % i for i in range(chunks - 2)]
    events.append(b'data: {"id":"cmpl-b","object":"text_completion","created":0,"model":"'
                  + MODEL.encode() + b'","choices":[],"usage":{"prompt_tokens":8192,'
                  b'"total_tokens":8203,"completion_tokens":11,'
                  b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n')
    events.append(b"data: [DONE]\n\n")
    return events


def serve(ready_file: str, chunks: int) -> None:
    """The scripted replica: every completion is ``chunks`` SSE events (one write each)."""
    events = _sse_events(chunks)

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            await asyncio.sleep(CHUNK_GAP_S)
        await response.write_eof()
        return response

    serve_scripted_replica(ready_file, completions, MODEL)


def _bodies(count: int, rng: random.Random) -> list[bytes]:
    return [json.dumps({
        "model": MODEL, "prompt": [rng.randrange(1000, 100_000) for _ in range(PROMPT_TOKENS)],
        "max_tokens": 11, "stream": True, "stream_options": {"include_usage": True},
    }, separators=(",", ":")).encode() for _ in range(count)]


async def _send(session: aiohttp.ClientSession, url: str, bodies: list[bytes],
                concurrency: int) -> float:
    """Send ``bodies`` ``concurrency`` at a time; returns the wall seconds. Raises
    ``RuntimeError`` on a non-200 answer or a stream without ``[DONE]``."""
    queue = collections.deque(bodies)

    async def worker() -> None:
        while queue:
            body = queue.popleft()
            async with session.post(url + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                answer = await resp.read()
                if resp.status != 200 or not answer.endswith(b"data: [DONE]\n\n"):
                    raise RuntimeError(f"HTTP {resp.status}: {answer[-200:]!r}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


def _phase_of(stack: list[str]) -> str:
    """The phase of one sampled stack (outermost frame first): see ``PHASES``."""
    for frame in reversed(stack):
        for phase, patterns in PHASES:
            if any(_matches(frame, pattern) for pattern in patterns):
                return phase
    return "other (event loop, aiohttp server and client, GC)"


def _matches(frame: str, pattern: str) -> bool:
    # a py-spy raw frame: "function (path/to/file.py:line)"
    function, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    file_part, _, func_part = pattern.partition(":")
    if not path.endswith(file_part) and f"/{file_part}" not in path:
        return False
    return not func_part or function.rsplit(".", 1)[-1] == func_part  # "Proxy._relay"


def phase_shares(raw: str) -> dict[str, float]:
    """{phase: share of the samples} of py-spy's ``--format raw`` output (one "stack count"
    line per distinct stack, frames separated by ';')."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if stack and count.isdigit() and not frames[-1].startswith(IDLE_FRAME):
            counts[_phase_of(frames)] += int(count)
    total = sum(counts.values()) or 1
    return {phase: n / total for phase, n in counts.most_common()}


async def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench_request_cpu_"))
    upstream = start_process([PYTHON, "-m", "loadtest.bench.request_cpu", "--serve",
                              str(tmp / "upstream.json"), "--chunks", str(args.chunks)],
                             log_path=tmp / "upstream.log")
    router = None
    try:
        replica_url = wait_ready(tmp / "upstream.json", [upstream], 60)["replicas"][0]["url"]
        router = start_process(
            [PYTHON, "-m", "router.cli", "serve", "--port", "0", "--replica", replica_url,
             "--tokenizer", str(default_tokenizer_dir()), "--ready-file", str(tmp / "router.json"),
             "--log-level", "warning"], log_path=tmp / "router.log",
            cwd=args.router_dir or None)
        router_url = wait_ready(tmp / "router.json", [router], 90)["url"]
        rng = random.Random(args.seed)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await _send(session, router_url, _bodies(args.warmup, rng), args.concurrency)
            bodies = _bodies(args.requests, rng)
            spy = None
            if args.profile:
                spy = await asyncio.create_subprocess_exec(
                    _py_spy(), "record", "--pid", str(router.pid), "--format", "raw",
                    "--rate", str(args.rate), "--nonblocking", "--output", str(tmp / "spy.txt"),
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                await asyncio.sleep(1.0)  # py-spy attaches
            cpu0, loop0 = cpu_seconds(router.pid), thread_cpu_seconds(router.pid, router.pid)
            wall = await _send(session, router_url, bodies, args.concurrency)
            cpu_ms = (cpu_seconds(router.pid) - cpu0) * 1e3 / len(bodies)
            loop_ms = (thread_cpu_seconds(router.pid, router.pid) - loop0) * 1e3 / len(bodies)
            async with session.get(router_url + "/debug/prefixes?top=0") as resp:
                audit = await resp.json()
        load = os.getloadavg()[0]
        print(f"router CPU {cpu_ms:.3f} ms/request over {len(bodies)} requests "
              f"(8k token ids, SSE {args.chunks} events, concurrency {args.concurrency}); "
              f"{len(bodies) / wall:.0f} req/s wall; load average {load:.1f}"
              + (" (under py-spy)" if spy is not None else ""), flush=True)
        print(f"  of which on the event loop's thread {loop_ms:.3f} ms, on the others (tokenizer, "
              f"rest hashing, template audit) {cpu_ms - loop_ms:.3f} ms", flush=True)
        if audit.get("enabled"):  # a dropped observation is audit work not done: compare alike
            print(f"template audit: {audit['observed_requests']} requests observed, "
                  f"{audit['dropped_requests']} dropped (warm-up included)", flush=True)
        if spy is not None:
            spy.send_signal(2)  # SIGINT: py-spy writes its samples and exits
            _, err = await asyncio.wait_for(spy.communicate(), 60)
            raw = (tmp / "spy.txt").read_text() if (tmp / "spy.txt").exists() else ""
            if not raw:
                print(f"py-spy wrote no samples: {err.decode(errors='replace')[-500:]}")
                return
            base = args.cpu_ms or cpu_ms
            print(f"phases (share of py-spy samples x {base:.3f} ms"
                  f"{'' if args.cpu_ms else ' measured under py-spy'}):")
            for phase, share in phase_shares(raw).items():
                print(f"  {phase:<48} {share * base * 1e3:7.0f} us  {share:6.1%}")
            if args.keep_profile:
                shutil.copy(tmp / "spy.txt", args.keep_profile)
    finally:
        stop_processes([p for p in (upstream, router) if p is not None])


def thread_cpu_seconds(pid: int, tid: int) -> float:
    """User + system CPU seconds thread ``tid`` of process ``pid`` has used (Linux
    ``/proc/PID/task/TID/stat``; the main thread's ``tid`` is ``pid``)."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1500, help="measured requests")
    parser.add_argument("--warmup", type=int, default=200, help="requests before measuring")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--chunks", type=int, default=13, help="SSE events per answer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true",
                        help="split the CPU into phases from py-spy samples")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--cpu-ms", type=float, default=0.0,
                        help="with --profile: the CPU ms/request of a run without the profiler "
                             "to split (default: the one measured under it)")
    parser.add_argument("--keep-profile", metavar="FILE", help="with --profile: copy the samples")
    parser.add_argument("--router-dir", help="run the router from this checkout")
    parser.add_argument("--serve", metavar="READY_FILE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.chunks)
        return
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
