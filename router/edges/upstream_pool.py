"""A small pooled HTTP/1.1 client for the proxy's requests to replicas, on httptools. HTTP edge.

The proxy's client for ``http://`` replicas by default (``upstream_client: httptools``;
``aiohttp`` sends over ``aiohttp.ClientSession`` instead): per request it writes the request
head and body in one write on a kept-alive connection and hands the parsed body chunks to the
relay, without aiohttp's request and response objects, tracing hooks, cookie and redirect
handling (``docs/benchmarks.md``, router CPU per request).

Scope, what the proxy needs and no more:

* ``http://`` replicas only (the proxy keeps the session for ``https://``); one request per
  connection at a time, no pipelining; a body of bytes sent with ``Content-Length``;
* responses with a ``Content-Length``, chunked or read-to-close bodies (httptools decodes the
  chunking); 1xx interim answers are skipped;
* idle connections are pooled per host and port, most recent first, and closed after
  ``idle_s`` (below the engine's keep-alive: uvicorn closes idle connections after 5 s);
* a connect that takes over ``connect_timeout_s`` fails with ``UpstreamConnectTimeout``; with a
  ``loop_lag`` its timer first gives back the time the router's loop ran late
  (``router.observability.loop_lag.LagTolerantTimeout``, as ``router.edges.upstream_connector``
  does for aiohttp's connects), at most ``MAX_CONNECT_TIMEOUTS`` connect timeouts in all;
* a response not read to its end when released, or closed (a cancelled request), closes its
  connection, so that the engine sees the disconnect and aborts the request;
* a body arriving faster than it is read pauses the socket's reading above
  ``HIGH_WATER_BYTES`` buffered.

Errors are ``UpstreamClientError`` subclasses whose ``cause`` is the proxy's name for them.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Final, cast
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from router.observability.loop_lag import MAX_CONNECT_TIMEOUTS, LagTolerantTimeout, LoopLag

HIGH_WATER_BYTES: Final = 256 * 1024  # buffered body bytes that pause reading the socket
SWEEP_S: Final = 1.0  # how often idle pooled connections are checked for expiry


class UpstreamClientError(Exception):
    """A request to a replica failed; ``cause`` names how (the proxy's retry causes)."""

    cause = "client_error"


class UpstreamConnectError(UpstreamClientError):
    """The connection could not be made; ``refused``: nothing listens (ECONNREFUSED)."""

    def __init__(self, message: str, refused: bool) -> None:
        super().__init__(message)
        self.cause = "connect_refused" if refused else "connect_error"


class UpstreamConnectTimeout(UpstreamClientError):
    cause = "connect_timeout"


class UpstreamDisconnected(UpstreamClientError):
    """The replica closed or reset the connection before its answer's head was complete."""

    cause = "disconnected"


class UpstreamPayloadError(UpstreamClientError):
    """The connection ended in the middle of a body (short of its length or chunking)."""

    cause = "payload_error"


class UpstreamBadResponse(UpstreamClientError):
    """What came back is not HTTP/1.x."""

    cause = "bad_response"


class PooledResponse(asyncio.Protocol):
    """One connection to a replica and the answer being read on it: ``status``, ``reason``,
    ``headers`` (once the head is in), ``readany()`` for the body. ``content`` is the object
    itself, so that the proxy reads it as it reads an ``aiohttp.ClientResponse``."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self._pool = pool
        self.key = key  # (host, port)
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.reason = ""
        self._reason = bytearray()
        self._raw_headers: list[tuple[str, str]] = []
        self.headers: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())
        self.content_length: int | None = None
        self.content_type = "application/octet-stream"
        self._chunked = False
        self._keep_alive = False
        self._interim = False  # reading a 1xx answer (skipped)
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._complete = False  # the answer's body ended
        self._error: UpstreamClientError | None = None
        self.closed = False
        self.idle_since = 0.0

    @property
    def content(self) -> PooledResponse:
        return self

    # -- the request ------------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> asyncio.Future[None]:
        """Write a request (``head`` ends with the blank line); the future is done when the
        answer's head (status and headers) is in, or fails with an ``UpstreamClientError``."""
        assert self.transport is not None
        self.status, self._reason, self._raw_headers = 0, bytearray(), []
        self.content_length, self._chunked, self._complete = None, False, False
        self._error = None
        self._head = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)  # one send: a 50 KB copy costs less than a syscall
        return self._head

    async def readany(self) -> bytes:
        """The body bytes buffered so far (waiting for some), ``b""`` at its end. Raises
        ``UpstreamPayloadError`` when the connection ended in the middle of it."""
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        if len(chunks) != 1:
            chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def at_eof(self) -> bool:
        """Whether the whole body was read."""
        return self._complete and not self._chunks

    def release(self) -> None:
        """The answer was read to its end: the connection goes back to the pool (or is closed
        when the replica asked for that)."""
        if self.closed:
            return
        if self.at_eof() and self._keep_alive:
            self._pool.put_back(self)
        else:
            self.close()

    def close(self) -> None:
        """Close the connection (a replica sees a request it was answering abandoned)."""
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)

    def data_received(self, data: bytes) -> None:
        if self._head is None:  # idle in the pool: nothing may come
            self._pool.discard(self)
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamBadResponse("the replica switched protocols"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBadResponse(f"not an HTTP answer: {exc}") if self.status == 0
                       else UpstreamPayloadError(f"bad body: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.discard(self)
        if self._head is None or self._complete:
            return
        if not self._head.done():
            self._fail(UpstreamDisconnected(f"connection closed before the answer: {exc}"))
        elif self.content_length is None and not self._chunked and exc is None:
            self.on_message_complete()  # a body that ends with the connection (HTTP/1.0 style)
        else:
            self._fail(UpstreamPayloadError(f"connection closed in the body: {exc}"))

    def pause_writing(self) -> None:  # flow control of the request body: the socket buffers it
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks ---------------------------------------------------------------

    def on_status(self, status: bytes) -> None:
        self._reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._interim, self._reason, self._raw_headers = True, bytearray(), []
            return
        self.status, self.reason = status, self._reason.decode("latin-1")
        headers = CIMultiDict(self._raw_headers)
        self.headers = CIMultiDictProxy(headers)
        length = headers.get("Content-Length")
        self.content_length = int(length) if length is not None and length.isdigit() else None
        self._chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()
        self._keep_alive = self._parser.should_keep_alive()  # (reset once the body is parsed)
        kind = headers.get("Content-Type")
        if kind is not None:
            self.content_type = kind.partition(";")[0].strip().lower()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._complete = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: UpstreamClientError) -> None:
        self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()
        self.close()


class UpstreamPool:
    """Kept-alive connections to replicas, per ``(host, port)``, and ``request`` over them.
    Not thread-safe: use on one event loop. ``loop_lag``: the connect timer gives back the
    loop's lateness (module docstring), ``on_give_back()`` called once per connect it did so."""

    def __init__(self, connect_timeout_s: float, idle_s: float, loop_lag: LoopLag | None = None,
                 on_give_back: Callable[[], None] | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self._loop_lag = loop_lag
        self._on_give_back = on_give_back
        self._idle: dict[tuple[str, int], list[PooledResponse]] = {}  # {(host, port): idle, oldest first}
        self._bases: dict[str, tuple[tuple[str, int], str, str]] = {}  # {base URL: (key, Host, path)}
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    @staticmethod
    def handles(url: str) -> bool:
        """Whether ``url`` is one this client serves (plain HTTP)."""
        return url.startswith("http://")

    async def request(self, method: str, base_url: str, path: str, body: bytes,
                      headers: CIMultiDict[str]) -> PooledResponse:
        """Send ``method`` ``base_url + path`` with ``headers`` (no hop-by-hop ones: ``Host`` and
        ``Content-Length`` are set here) and ``body``; returns once the answer's head is in.
        The caller reads the body (``readany``) and then calls ``release`` or ``close``.
        Raises ``UpstreamClientError`` subclasses; cancelled, it closes the connection."""
        key, host, prefix = self._base(base_url)
        lines = [f"{method} {prefix}{path} HTTP/1.1\r\nHost: {host}\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in headers.items()]
        lines.append(f"Content-Length: {len(body)}\r\n\r\n")
        head = "".join(lines).encode("utf-8", "surrogateescape")
        conn = self._pooled(key)
        if conn is None:
            conn = await self._connect(key)
        try:
            await conn.send(head, body)
        except BaseException:
            conn.close()
            raise
        return conn

    def put_back(self, conn: PooledResponse) -> None:
        if self._closed or conn.transport is None or conn.transport.is_closing():
            conn.close()
            return
        conn._head = None  # idle: anything the replica sends now closes it
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)

    def discard(self, conn: PooledResponse) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        """Close every idle connection (the ones in use close when their requests end)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    def _base(self, base_url: str) -> tuple[tuple[str, int], str, str]:
        found = self._bases.get(base_url)
        if found is None:
            parts = urlsplit(base_url)
            port = parts.port or 80
            host = parts.hostname or ""
            found = ((host, port), parts.netloc, parts.path.rstrip("/"))
            if len(self._bases) < 4096:
                self._bases[base_url] = found
        return found

    def _pooled(self, key: tuple[str, int]) -> PooledResponse | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()  # the most recently used: the least likely closed by the replica
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                return conn
        return None

    async def _connect(self, key: tuple[str, int]) -> PooledResponse:
        loop = asyncio.get_running_loop()
        timeout_s = self.connect_timeout_s
        deadline: AbstractAsyncContextManager[object] = (
            asyncio.timeout(timeout_s) if self._loop_lag is None else
            LagTolerantTimeout(self._loop_lag, timeout_s, MAX_CONNECT_TIMEOUTS * timeout_s))
        try:
            async with deadline:
                _, conn = await loop.create_connection(lambda: PooledResponse(self, key), *key)
        except TimeoutError as exc:
            raise UpstreamConnectTimeout(
                f"connect to {key[0]}:{key[1]} took over {timeout_s:g} s of the router's "
                "loop running on time") from exc
        except OSError as exc:
            raise UpstreamConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}",
                                       refused=isinstance(exc, ConnectionRefusedError)) from exc
        finally:
            if (isinstance(deadline, LagTolerantTimeout) and deadline.num_extended
                    and self._on_give_back is not None):
                self._on_give_back()
        return conn

    def _sweep(self) -> None:
        self._sweeper = None
        expired = time.monotonic() - self.idle_s
        for idle in self._idle.values():
            while idle and idle[0].idle_since <= expired:
                idle.pop(0).close()
        if any(self._idle.values()):
            self._sweeper = asyncio.get_running_loop().call_later(SWEEP_S, self._sweep)
