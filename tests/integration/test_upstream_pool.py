"""The proxy's httptools upstream client (``router.edges.upstream_pool``) against real servers on
127.0.0.1, port 0: an aiohttp server for well-formed answers, raw asyncio servers for the
malformed and the broken ones; and a router process with either client in front of a replica
whose stream breaks. The router's other tests run it end to end (the default
``upstream_client``; ``ROUTER_UPSTREAM_CLIENT=aiohttp`` runs them over ``ClientSession``,
docs/router.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from multidict import CIMultiDict

from router.edges.upstream_pool import (
    PooledResponse,
    UpstreamBadResponse,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamPayloadError,
    UpstreamPool,
)
from router.service.config import UPSTREAM_CLIENTS
from tests.helpers import FAKE_REPLICA_TAIL
from tests.integration.test_router_fleet import Router, scripted_replica

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

EVENTS = [b"data: %d\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]


async def _read_all(conn: PooledResponse) -> bytes:
    out = bytearray()
    while chunk := await conn.readany():
        out += chunk
    return bytes(out)


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[web.Request], asyncio.Event]]:
    """An aiohttp replica: /sse streams ``EVENTS`` (chunked), /json answers with a length,
    /echo returns the body and headers it got, /hang never answers (sets the event when its
    handler is cancelled: the client closed the connection)."""
    seen: list[web.Request] = []
    cancelled = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        seen.append(request)
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in EVENTS:
            await response.write(event)
            await asyncio.sleep(0.001)
        await response.write_eof()
        return response

    async def echo(request: web.Request) -> web.Response:
        seen.append(request)
        body = await request.read()
        return web.json_response({"body": body.decode(), "path": request.path_qs,
                                  "headers": dict(request.headers)}, status=201)

    async def hang(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return web.Response()

    app = web.Application()
    app.add_routes([web.post(path, handler) for path, handler in (
        ("/sse", sse), ("/echo", echo), ("/prefix/echo", echo), ("/hang", hang))])
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", seen, cancelled
    finally:
        await runner.cleanup()


async def _raw_server(answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                       Awaitable[None]]) -> tuple[asyncio.Server, str]:
    srv = await asyncio.start_server(answer, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


async def test_streams_sse_and_reuses_the_connection(server: tuple[str, list, asyncio.Event]) -> None:
    url, seen, _ = server
    pool = UpstreamPool(connect_timeout_s=5, idle_s=4)
    headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": "r1"})
    conn = await pool.request("POST", url, "/sse", b'{"a": 1}', headers)
    assert conn.status == 200 and conn.content_type == "text/event-stream"
    assert conn.content_length is None
    assert await _read_all(conn) == b"".join(EVENTS)  # byte identity, chunking decoded
    assert conn.at_eof()
    conn.release()
    again = await pool.request("POST", url, "/echo", b"hello", headers)
    assert again is conn  # the kept-alive connection
    assert again.status == 201 and again.reason == "Created"
    answer = await _read_all(again)
    assert again.content_length == len(answer)
    echoed = json.loads(answer)
    assert echoed["body"] == "hello"
    assert {k.lower(): v for k, v in echoed["headers"].items()}["x-request-id"] == "r1"
    again.release()
    assert [r.headers["Host"] for r in seen] == [url.removeprefix("http://")] * 2
    pool.close()


async def test_a_base_url_path_prefixes_the_request_path(
        server: tuple[str, list, asyncio.Event]) -> None:
    url, _, _ = server
    pool = UpstreamPool(connect_timeout_s=5, idle_s=4)
    conn = await pool.request("POST", url + "/prefix", "/echo", b"", CIMultiDict())
    assert conn.status == 201 and b'"path": "/prefix/echo"' in await _read_all(conn)
    conn.close()
    pool.close()


async def test_cancelling_closes_the_connection(server: tuple[str, list, asyncio.Event]) -> None:
    url, _, cancelled = server
    pool = UpstreamPool(connect_timeout_s=5, idle_s=4)
    task = asyncio.ensure_future(pool.request("POST", url, "/hang", b"x", CIMultiDict()))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(cancelled.wait(), 10)  # the replica saw the disconnect
    pool.close()


async def test_refused_and_broken_answers_name_their_cause() -> None:
    pool = UpstreamPool(connect_timeout_s=5, idle_s=4)
    srv, url = await _raw_server(lambda r, w: asyncio.sleep(0))
    srv.close()
    await srv.wait_closed()
    with pytest.raises(UpstreamConnectError) as refused:
        await pool.request("POST", url, "/x", b"", CIMultiDict())
    assert refused.value.cause == "connect_refused"

    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    async def short_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly this")
        await writer.drain()
        writer.close()

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        await writer.drain()
        writer.close()

    for answer, error in ((close_at_once, UpstreamDisconnected), (not_http, UpstreamBadResponse)):
        srv, url = await _raw_server(answer)
        with pytest.raises(error):
            await pool.request("POST", url, "/x", b"", CIMultiDict())
        srv.close()
    srv, url = await _raw_server(short_body)
    conn = await pool.request("POST", url, "/x", b"", CIMultiDict())
    with pytest.raises(UpstreamPayloadError):
        await _read_all(conn)
    srv.close()
    srv, url = await _raw_server(until_close)
    conn = await pool.request("POST", url, "/x", b"", CIMultiDict())
    assert await _read_all(conn) == b"all of it" and conn.at_eof()
    conn.release()  # HTTP/1.0 without keep-alive: closed, not pooled
    assert conn.closed
    srv.close()
    pool.close()


BROKEN_SSE_SERVER = """
import asyncio, json, sys
from aiohttp import web
async def completions(request):
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(2):
        await resp.write(b'data: {"i": %d}\\n\\n' % i)
    await asyncio.sleep(0.2)
    request.transport.close()  # the engine dies mid-stream: the chunked body never ends
    await asyncio.sleep(1)
    return resp""" + FAKE_REPLICA_TAIL


@pytest.mark.parametrize("client", UPSTREAM_CLIENTS)
def test_a_stream_broken_mid_body_ends_with_an_sse_error(client: str, tmp_path: Path) -> None:
    """Either upstream client: a replica's connection lost in the middle of a chunked SSE body
    ends the client's stream with the events relayed so far and a 502 error event, counted as
    ``stream_broken``."""
    with scripted_replica(BROKEN_SSE_SERVER) as url:
        router = Router(tmp_path, ["--replica", url], env={"ROUTER_UPSTREAM_CLIENT": client})
        try:
            status, _, body = router.post("/v1/completions",
                                          {"model": "fixed", "prompt": [1], "stream": True})
            assert status == 200
            *events, error = body.split(b"\n\n")[:3]
            assert events == [b'data: {"i": %d}' % i for i in range(2)]
            payload = json.loads(error.removeprefix(b"data: "))["error"]
            assert payload["code"] == 502 and "stream_broken" in payload["message"]
            assert 'router_upstream_errors_total{kind="stream_broken",replica=' in router.metrics()
        finally:
            router.stop()
