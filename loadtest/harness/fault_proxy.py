"""A fault-injecting HTTP proxy in front of one replica, for failure tests and measurements.

``python -m loadtest.harness.fault_proxy --target http://127.0.0.1:PORT --port 0 --ready-file F``
relays every request to the target unchanged (streamed, headers and status kept) except
generation requests (``POST /v1/completions``, ``/v1/chat/completions``) while a fault is
set, so the replica's ``/health``, ``/metrics`` and ``/v1/models`` stay fine, as in the
failures seen in production. Faults (``POST /_fault {"mode": ...}``, read back with
``GET /_fault``, which also counts the generation requests received):

* ``pass``: relay (the default);
* ``500``: answer ``500`` with an OpenAI-shaped error at once;
* ``hang``: accept the request and never answer (until the client gives up);
* ``401`` / ``404``: answer as vLLM's API server does without the engine, for a request without
  the replica's API key (``{"error": "Unauthorized"}``) or for a model it does not serve;
* ``no-accept``: accept no new connection, as a replica whose accept backlog is full: the
  listening socket's accept queue is filled, so the kernel drops new SYNs and a client's connect
  pends (retransmitting) until the mode is lifted. Every open connection but the one that set
  the mode is closed once idle, so clients must connect anew; set another mode on that same
  (keep-alive) connection to accept again.

With ``"scope": "all"`` the fault applies to every request (a stalled engine), not only to
generation requests.

The ready file holds ``{"url": ...}`` once listening. I/O only; no router code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

import aiohttp
from aiohttp import web

from router.edges.circuit_probe import PROBE_HEADER

GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MODES = ("pass", "500", "hang", "401", "404", "no-accept")
BACKLOG = 128
_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "host"})


class Gate:
    """The proxy's listening socket with an accept loop that can stop (``no-accept``)."""

    def __init__(self, server: web.Server, port: int) -> None:
        self.server = server
        self.sock = socket.create_server(("127.0.0.1", port), backlog=BACKLOG)
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self.fillers: list[socket.socket] = []  # connections that keep the accept queue full
        self.task: asyncio.Task[None] | None = None

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self.sock)
            await loop.connect_accepted_socket(self.server, conn)

    def open(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.fillers.clear()
        self.sock.listen(BACKLOG)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._accept())

    def close(self) -> None:
        """Stop accepting and fill the accept queue (a backlog of 0 holds one connection in
        Linux) until a connect pends: the kernel then drops every new SYN."""
        if self.task is not None:
            self.task.cancel()
        self.sock.listen(0)
        for _ in range(BACKLOG):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(("127.0.0.1", self.port))
            _, writable, _ = select.select([], [filler], [], 0.2)
            if not writable or filler.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                filler.close()  # its SYN was dropped: the queue is full
                return
            self.fillers.append(filler)


class FaultProxy:
    def __init__(self, target: str, mode: str = "pass") -> None:
        self.target = target.rstrip("/")
        self.mode = mode
        self.scope = "generate"  # or "all"
        self.generate_requests = 0  # generation requests received, any mode
        self.probe_requests = 0  # of which the router's half-open probes (router.edges.circuit_probe)
        self.session: aiohttp.ClientSession | None = None
        self.gate: Gate | None = None

    async def fault(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            data = await request.json()
            mode, scope = str(data.get("mode")), str(data.get("scope", "generate"))
            if mode not in MODES or scope not in ("generate", "all"):
                return web.json_response({"error": f"mode must be one of {MODES}, scope "
                                                   "generate or all"}, status=400)
            self.mode, self.scope = mode, scope
            if self.gate is not None:
                self.set_gate(request)
        return web.json_response({"mode": self.mode, "scope": self.scope,
                                  "generate_requests": self.generate_requests,
                                  "probe_requests": self.probe_requests})

    def set_gate(self, request: web.Request) -> None:
        assert self.gate is not None
        if self.mode != "no-accept":
            self.gate.open()
            return
        self.gate.close()
        for handler in self.gate.server.connections:
            if handler is not request.protocol:
                handler.close()  # closed once its request is answered

    async def relay(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        generate = request.method == "POST" and request.path in GENERATE_PATHS
        self.generate_requests += generate
        self.probe_requests += generate and PROBE_HEADER in request.headers
        if generate or self.scope == "all":
            if self.mode == "500":
                return web.json_response({"error": {"message": "injected engine failure",
                                                    "type": "InternalServerError", "code": 500}},
                                         status=500)
            if self.mode == "401":  # vLLM's api_server.py authentication middleware
                return web.json_response({"error": "Unauthorized"}, status=401)
            if self.mode == "404":
                return web.json_response({"error": {"message": "The model does not exist.",
                                                    "type": "NotFoundError", "code": 404}},
                                         status=404)
            if self.mode == "hang":
                await asyncio.Event().wait()  # until the client disconnects (handler cancelled)
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with self.session.request(request.method, self.target + request.path_qs,
                                        data=body or None, headers=headers,
                                        auto_decompress=False) as upstream:
            out = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in _HOP})
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()


def _write_ready_file(path: str, url: str) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps({"url": url}))
    os.replace(tmp, path)


async def _serve(args: argparse.Namespace) -> None:
    proxy = FaultProxy(args.target, args.mode)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_route("*", "/_fault", proxy.fault)
    app.router.add_route("*", "/{tail:.*}", proxy.relay)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    assert runner.server is not None
    proxy.gate = gate = Gate(runner.server, args.port)  # not a TCPSite: its accepts can stop
    port = gate.port
    if proxy.mode == "no-accept":
        gate.close()
    else:
        gate.open()
    if args.ready_file:
        _write_ready_file(args.ready_file, f"http://127.0.0.1:{port}")
    try:
        await asyncio.Event().wait()
    finally:
        if gate.task is not None:
            gate.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gate.task
        gate.sock.close()
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.harness.fault_proxy", description=__doc__)
    parser.add_argument("--target", required=True, help="base URL of the replica")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mode", choices=MODES, default="pass")
    parser.add_argument("--ready-file", default=None)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
