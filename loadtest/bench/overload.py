"""Overload benchmark: many concurrent streams through the router against a healthy emulated
fleet (issue 29). Does process and network I/O.

``python -m loadtest.bench.overload [--streams 1000] [--seconds 60] [--replicas 4]
[--time-scale 20]``

Starts a ``loadtest.harness.fleet.LoopbackFleet`` (real Redis, one emulator process with ``--replicas``
replicas at ``--time-scale``, a worker each, the router), then runs ``--streams`` client loops
for ``--seconds``: each sends streamed completions (``--prompt-tokens`` token ids, a shared
head per group of prompts, ``--max-tokens`` out) one after another and reads each SSE stream
to its end. When the time is up every loop finishes its current stream and the client session
closes. Meanwhile ``/ready`` is read once a second (samples with a replica not routable, why,
with panic mode on). Printed as one JSON object: requests, answers by status, 503s by error message,
other errors (connection failures, streams without ``[DONE]``, SSE error events), the router's
own ``router_requests_total`` 503s by reason and ``router_panic_routed_requests_total``, and the
router's open fds (``/proc/<pid>/fd``) idle before the run, at the end of the last stream and
``--settle-s`` later, with the load average before and after. A machine busy with other work
is part of the figures: run ``uptime`` alongside.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.harness.fleet import OURS, FleetConfig, LoopbackFleet, RouterSpec

PROMPT_GROUPS = 64  # distinct prompt heads: some prefix reuse, as a real fleet sees
VOCAB = 30_000  # token ids drawn below this


def router_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def router_counts(metrics: str) -> dict[str, Any]:
    """``router_requests_total`` by status and its 503s by reason, the panic counter, the upstream errors by kind
    and the timeouts not counted because the router's loop ran late
    (``router_loop_late_verdicts_total``) by kind, from ``/metrics`` text."""
    by_reason: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    late: Counter[str] = Counter()
    panic = 0.0
    for line in metrics.splitlines():
        kind = re.search(r'kind="([^"]*)"', line)
        if line.startswith("router_requests_total{"):
            status = re.search(r'status="([^"]*)"', line)
            statuses[status.group(1) if status else "?"] += int(float(line.rsplit(" ", 1)[1]))
        if line.startswith("router_requests_total{") and 'status="503"' in line:
            reason = re.search(r'reason="([^"]*)"', line)
            by_reason[reason.group(1) if reason else "?"] += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("router_panic_routed_requests_total "):
            panic = float(line.rsplit(" ", 1)[1])
        elif line.startswith(("router_upstream_errors_total{", "router_loop_late_verdicts_total{")):
            out = errors if line.startswith("router_upstream") else late
            out[kind.group(1) if kind else "?"] += int(float(line.rsplit(" ", 1)[1]))
    return {"statuses": dict(statuses), "503_by_reason": dict(by_reason), "panic_routed_requests": int(panic),
            "upstream_errors_by_kind": dict(errors), "loop_late_by_kind": dict(late)}


class Load:
    """The client side: ``streams`` loops of streamed completions until ``deadline``."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.url = url
        self.args = args
        self.statuses: Counter[int] = Counter()
        self.messages_503: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.error_messages: Counter[str] = Counter()  # {type and message: count}
        self.requests = 0
        self.last_stream_end = 0.0
        rng = random.Random(29)
        head = args.prompt_tokens // 2
        self.heads = [[rng.randrange(VOCAB) for _ in range(head)] for _ in range(PROMPT_GROUPS)]

    def prompt(self, rng: random.Random) -> list[int]:
        tail = self.args.prompt_tokens - len(self.heads[0])
        return [*rng.choice(self.heads), *(rng.randrange(VOCAB) for _ in range(tail))]

    async def one(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        body = {"model": "emulated-llm", "prompt": self.prompt(rng), "stream": True,
                "max_tokens": self.args.max_tokens, "temperature": 0.0}
        self.requests += 1
        try:
            async with session.post(self.url + "/v1/completions", json=body) as resp:
                self.statuses[resp.status] += 1
                if resp.status != 200:
                    text = await resp.text()
                    if resp.status == 503:
                        try:
                            message = json.loads(text)["error"]["message"]
                        except (ValueError, KeyError, TypeError):
                            message = text[:80]
                        self.messages_503[message] += 1
                    return
                done = False
                async for line in resp.content:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b'data: {"error"'):
                        self.errors["sse_error_event"] += 1
                if not done:
                    self.errors["stream_without_done"] += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.errors[type(exc).__name__] += 1
            self.error_messages[f"{type(exc).__name__}: {exc}"[:160]] += 1
        finally:
            self.last_stream_end = time.monotonic()

    async def loop(self, session: aiohttp.ClientSession, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        await asyncio.sleep(rng.random() * 2.0)  # ramp up over 2 s, not one burst of connects
        while time.monotonic() < deadline:
            await self.one(session, rng)

    async def run(self) -> None:
        deadline = time.monotonic() + self.args.seconds
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self.loop(session, i, deadline)
                                   for i in range(self.args.streams)))


async def watch_fds(pid: int, stop: asyncio.Event, out: Counter[str]) -> None:
    """The router's open fds, most seen, sampled 4 times a second until ``stop``."""
    while not stop.is_set():
        out["max"] = max(out["max"], router_fds(pid))
        await asyncio.sleep(0.25)


async def watch_ready(url: str, stop: asyncio.Event, out: Counter[str]) -> None:
    """Sample ``/ready`` once a second until ``stop``: how often a replica was not routable."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while not stop.is_set():
            try:
                async with session.get(url + "/ready") as resp:
                    body = await resp.json()
                out["samples"] += 1
                reps = body.get("replicas", [])
                if any(not r["routable"] for r in reps):
                    out["some_replica_not_routable"] += 1
                for r in reps:
                    if not r["routable"]:  # "not_routable: circuit open for 4.1 s more ..."
                        reason = re.sub(r"[0-9.]+ s", "N s", str(r["not_routable_reason"]))
                        out[f"not_routable: {reason}"] += 1
                if reps and not any(r["routable"] for r in reps):
                    out["no_replica_routable"] += 1
                if body.get("panic", {}).get("active"):
                    out["panic_active"] += 1
            except (aiohttp.ClientError, TimeoutError, ValueError):
                out["ready_unanswered"] += 1
            with_timeout = asyncio.ensure_future(stop.wait())
            await asyncio.wait([with_timeout], timeout=1.0)
            with_timeout.cancel()


async def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    await asyncio.sleep(2.0)
    fds_idle = router_fds(pid)
    load_before = load_average()
    load = Load(url, args)
    stop = asyncio.Event()
    ready: Counter[str] = Counter()
    watcher = asyncio.create_task(watch_ready(url, stop, ready))
    fds: Counter[str] = Counter()
    fds_watcher = asyncio.create_task(watch_fds(pid, stop, fds))
    started = time.monotonic()
    await load.run()  # returns once every stream ended and the client session closed
    elapsed = time.monotonic() - started
    stop.set()
    await watcher
    await fds_watcher
    fds_end = router_fds(pid)
    await asyncio.sleep(max(0.0, load.last_stream_end + args.settle_s - time.monotonic()))
    fds_settled = router_fds(pid)
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
        counts = router_counts(await resp.text())
    return {
        "streams": args.streams, "seconds": args.seconds, "replicas": args.replicas,
        "time_scale": args.time_scale, "elapsed_s": round(elapsed, 1),
        "requests": load.requests, "statuses": dict(load.statuses),
        "503_messages": dict(load.messages_503), "errors": dict(load.errors),
        "error_messages": dict(load.error_messages.most_common(8)),
        "router": counts, "ready_samples": dict(ready),
        "router_fds": {"idle": fds_idle, "most_during": fds["max"], "at_end": fds_end,
                       f"{args.settle_s:g}_s_after": fds_settled,
                       "within_10_percent": fds_settled <= fds_idle * 1.1},
        "load_average": {"before": load_before, "after": load_average()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--settle-s", type=float, default=10.0,
                        help="seconds after the last stream at which fds are counted again")
    parser.add_argument("--router-arg", action="append", default=[],
                        help="extra router flag (repeatable), e.g. --router-arg=--panic-threshold=0")
    parser.add_argument("--log-dir", type=Path, help="keep every component's log here")
    args = parser.parse_args()
    config = FleetConfig(router=RouterSpec(OURS, "prefix"), replicas=args.replicas,
                         time_scale=args.time_scale, router_args=tuple(args.router_arg),
                         log_dir=args.log_dir)
    with LoopbackFleet(config, progress=lambda msg: print(msg, flush=True)) as fleet:
        assert fleet.router_url is not None
        pid = fleet.pids["router"][0]
        result = asyncio.run(measure(fleet.router_url, pid, args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
