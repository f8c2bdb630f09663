"""Benchmark of the router's streaming relay: router CPU per streamed request.

``python -m loadtest.bench.relay [--events 200] [--gap-ms 2] [--concurrency 40] [--waves 5]``

Starts an upstream (this module with ``--serve``: an aiohttp server whose completions stream
``--events`` server-sent events ``--gap-ms`` apart, then ``[DONE]``) and a router in front of it
(static replica), sends ``--waves`` waves of ``--concurrency`` concurrent streamed requests
through the router after a warm-up wave, and reports the router process's CPU time (from /proc)
per streamed request and per relayed event. Figures, not pass/fail; for an A/B run it from each
checkout (the router process is started from the current directory's code).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import urllib.request
from pathlib import Path

import aiohttp
from aiohttp import web

from loadtest.harness.processes import (
    PYTHON,
    cpu_seconds,
    free_port,
    start_process,
    stop_process,
    wait_for,
)


def serve(port: int, events: int, gap_s: float) -> None:
    """The streaming upstream: every completion is ``events`` SSE events ``gap_s`` apart."""

    routes = web.RouteTableDef()

    @routes.post("/v1/completions")
    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(events):
            await resp.write(b'data: {"choices": [{"text": " tok"}], "i": %d}\n\n' % i)
            await asyncio.sleep(gap_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @routes.get("/health")
    @routes.get("/v1/models")
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fixed", "object": "model"}]})

    app = web.Application()
    app.add_routes(routes)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


async def _waves(router_url: str, router_pid: int, concurrency: int, waves: int) -> float:
    """Router CPU seconds over ``waves`` waves of ``concurrency`` streamed requests."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            async with session.post(router_url + "/v1/completions", json={
                    "model": "fixed", "prompt": [1, 2, 3], "stream": True}) as resp:
                tail = b""
                async for chunk in resp.content.iter_any():
                    tail = (tail + chunk)[-64:]
                if resp.status != 200 or not tail.endswith(b"data: [DONE]\n\n"):
                    raise RuntimeError(f"stream failed: {resp.status} {tail!r}")

        await asyncio.gather(*[one() for _ in range(concurrency)])  # warm-up: connections
        before = cpu_seconds(router_pid)
        for _ in range(waves):
            await asyncio.gather(*[one() for _ in range(concurrency)])
        return cpu_seconds(router_pid) - before


def _ready(router_url: str) -> bool:
    try:
        with urllib.request.urlopen(router_url + "/ready", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench.relay", description=__doc__)
    parser.add_argument("--events", type=int, default=200, help="SSE events per response")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="ms between two events")
    parser.add_argument("--concurrency", type=int, default=40, help="streams at once")
    parser.add_argument("--waves", type=int, default=5, help="waves of --concurrency streams")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.events, args.gap_ms / 1000)
        return 0
    port = free_port()
    upstream = start_process([PYTHON, "-m", "loadtest.bench.relay", "--serve", str(port),
                              "--events", str(args.events), "--gap-ms", str(args.gap_ms)])
    router = None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ready = Path(tmp) / "router.json"
            router = start_process([PYTHON, "-m", "router.cli", "serve", "--port", "0",
                                    "--replica", f"http://127.0.0.1:{port}",
                                    "--ready-file", str(ready), "--log-level", "warning"])
            wait_for(ready.exists, 60, 0.05, "router ready file")
            router_url = json.loads(ready.read_text())["url"]
            # the router routes once its first probe found the static replica healthy
            wait_for(lambda: _ready(router_url), 30, 0.1, "router ready")
            cpu = asyncio.run(_waves(router_url, router.pid, args.concurrency, args.waves))
    finally:
        if router is not None:
            stop_process(router)
        stop_process(upstream)
    num = args.concurrency * args.waves
    print(json.dumps({"streams": num, "events_per_stream": args.events,
                      "router_cpu_ms_per_stream": round(cpu * 1e3 / num, 3),
                      "router_cpu_us_per_event": round(cpu * 1e6 / num / args.events, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
