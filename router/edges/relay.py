"""A replica's answer relayed to the client once its first body byte came. HTTP edge.

Before that byte the proxy (``router.edges.proxy``) may still retry elsewhere; from here on
nothing is retried:

* the answer is relayed chunk by chunk as it arrives (no buffering); a whole body that came in
  the first read goes out in one write, headers and body together;
* a stream-idle timeout (``RouterConfig.stream_idle_timeout_s``) covers the replica's reads, not
  the client's writes;
* a stream that breaks or goes idle counts against the replica (``router_upstream_errors_total``,
  and the outcome's status 502/504 for its circuit breaker): an SSE stream gets a
  ``data: {"error": {...}}`` event (the API's own, ``router.apis.error_shapes``) and closes, other
  bodies are cut short and the connection closed (the client sees a short body, never a silent
  success);
* the client going away mid-answer is the outcome ``STATUS_CLIENT_CLOSED``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.apis.error_shapes import SSE_ERROR_EVENTS, UPSTREAM_ERROR_BODIES
from router.decision.health import ReplicaHealth
from router.edges.upstream_pool import PooledResponse, UpstreamClientError
from router.observability.metrics import RouterMetrics
from router.request.errors import STATUS_CLIENT_CLOSED, error_body
from router.request.usage import TAIL_BYTES, TAIL_CHUNKS, joined_tail, trim_tail
from router.service.config import RouterConfig

logger = logging.getLogger(__name__)

# a relayed stream's progress (``ReplicaHealth.progress``) is recorded at most this often: the
# stall detector judges over seconds (its deadline floor), and a record per chunk cost a call
PROGRESS_SAMPLE_S: Final = 0.05

UpstreamResponse: TypeAlias = aiohttp.ClientResponse | PooledResponse


@dataclass(slots=True)
class ProxyOutcome:
    """What happened, for metrics: final replica, HTTP status sent, first-byte time."""

    replica_id: str
    status: int
    first_byte_s: float | None = None
    tail: bytes = b""  # the answer's last ``router.request.usage.TAIL_BYTES`` (SSE, or a one-read body)
    head: bytes = b""  # the answer's first ``router.edges.proxy.HEAD_BYTES`` (a Responses id)


class Relay:
    """Relays answers for the proxy: ``answer`` writes one to the client."""

    __slots__ = ("config", "health", "metrics")

    def __init__(self, config: RouterConfig, metrics: RouterMetrics,
                 health: ReplicaHealth) -> None:
        self.config = config
        self.metrics = metrics
        self.health = health

    async def answer(self, request: web.Request, upstream: UpstreamResponse,
                     headers: CIMultiDict[str], outcome: ProxyOutcome, path: str, first: bytes,
                     request_id: str) -> web.StreamResponse:
        """Answer ``request`` with ``upstream``'s status, ``headers`` (the proxy's) and body,
        ``first`` its first read, ``path`` the upstream path (its API's error shapes). Sets the
        ``outcome``'s tail, and its status when the stream failed or the client went away."""
        response: web.StreamResponse
        try:
            if upstream.content_length is not None and len(first) == upstream.content_length:
                # the whole (non-streamed) body came in the first read: one write, headers
                # and body together
                outcome.tail = first[-TAIL_BYTES:]  # the usage, for the template audit
                reshape = UPSTREAM_ERROR_BODIES.get(path)
                if reshape is not None and upstream.status >= 400 and (
                        "content-encoding" not in upstream.headers):
                    first = reshape(first, upstream.status)  # the API's own error shape
                response = web.Response(status=upstream.status, reason=upstream.reason,
                                        body=first, headers=headers)
                await response.prepare(request)
                await response.write_eof()
            else:
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                              headers=headers)
                if upstream.content_length is not None:
                    response.content_length = upstream.content_length
                await response.prepare(request)
                if first:
                    await response.write(first)
                await self._stream(upstream, response, outcome, path, first)
        except ConnectionResetError:
            # the client went away between two chunks (aiohttp raises on the write rather
            # than cancelling the handler): same outcome as a cancelled request
            logger.info("client closed %s mid-response from %s", request_id, outcome.replica_id)
            outcome.status = STATUS_CLIENT_CLOSED
        return response

    async def _stream(self, upstream: UpstreamResponse, response: web.StreamResponse,
                      outcome: ProxyOutcome, path: str, first: bytes) -> None:
        """Relay the rest of the body (after ``first``) chunk by chunk, doing little per chunk:

        * the stream-idle timeout covers the reads only (a slow client is not the replica's
          fault); it is one watchdog per response whose timer is re-armed only when it fires, a
          chunk just moving its deadline (``asyncio.timeout`` per read created and cancelled a
          timer per chunk; ``loadtest.bench.relay``);
        * the replica's progress (``ReplicaHealth.progress``, for the stall detector, which
          judges over seconds) is recorded at most every ``PROGRESS_SAMPLE_S``;
        * an SSE answer's tail (``outcome.tail``: the usage event) is found by keeping the last
          chunks and joining them once at the end (``router.request.usage.joined_tail``).
        """
        idle = self.config.stream_idle_timeout_s
        is_sse = upstream.content_type == "text/event-stream"
        rid = outcome.replica_id
        read, write, progress = upstream.content.readany, response.write, self.health.progress
        loop = asyncio.get_running_loop()
        clock = time.monotonic  # the clock ``ReplicaHealth`` and the loop's deadlines share
        chunks = [first]
        keep = chunks.append
        next_progress = 0.0  # a chunk arriving at or after it is recorded as progress
        reading = False
        try:
            async with _IdleWatch(loop, idle) as watch:
                while True:
                    reading = True
                    watch.deadline = loop.time() + idle
                    chunk = await read()
                    watch.deadline = math.inf
                    reading = False
                    if not chunk:
                        break
                    if is_sse:
                        keep(chunk)
                        if len(chunks) >= TAIL_CHUNKS:
                            trim_tail(chunks)
                    now = clock()
                    if now >= next_progress:
                        progress(rid, now)
                        next_progress = now + PROGRESS_SAMPLE_S
                    await write(chunk)
        except (TimeoutError, aiohttp.ClientError, UpstreamClientError) as exc:
            if not reading:  # the client's side failed (aiohttp raises a ClientError subclass)
                raise
            await self._stream_failed(isinstance(exc, TimeoutError), response, rid, outcome,
                                      path, is_sse)
            return
        finally:
            if is_sse:
                outcome.tail = joined_tail(chunks)
        await response.write_eof()

    async def _stream_failed(self, idle: bool, response: web.StreamResponse, rid: str,
                             outcome: ProxyOutcome, path: str, is_sse: bool) -> None:
        """The replica's stream broke (or went ``idle`` past the timeout) after the client got
        bytes: counted, and an SSE answer ends with the API's error event, another is cut."""
        kind = "stream_idle_timeout" if idle else "stream_broken"
        self.metrics.upstream_errors.labels(rid, kind).inc()
        outcome.status = 504 if idle else 502
        logger.warning("upstream %s failed mid-response: %s", rid, kind)
        if not is_sse:
            response.force_close()
            return
        message = f"replica {rid} stream failed: {kind}"
        error_type = "BadGatewayError" if outcome.status == 502 else "GatewayTimeoutError"
        event = SSE_ERROR_EVENTS.get(path)  # the API's own error event (router.apis)
        await response.write(event(message, error_type, outcome.status) if event else
                             b"data: " + error_body(message, error_type, outcome.status) + b"\n\n")
        await response.write_eof()


class _IdleWatch:
    """An ``asyncio.timeout`` that expires once the loop time passes ``deadline`` (``math.inf``:
    not while it is), checked by one timer re-armed only when it fires: moving the deadline
    costs an assignment, where ``asyncio.timeout`` per read created and cancelled a timer."""

    __slots__ = ("_handle", "_idle_s", "_loop", "_timeout", "deadline")

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float) -> None:
        self._loop = loop
        self._idle_s = idle_s
        self._timeout = asyncio.timeout(None)
        self._handle: asyncio.TimerHandle | None = None
        self.deadline = math.inf

    async def __aenter__(self) -> _IdleWatch:
        await self._timeout.__aenter__()
        self._handle = self._loop.call_at(self._loop.time() + self._idle_s, self._check)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        if self._handle is not None:
            self._handle.cancel()
        await self._timeout.__aexit__(*exc_info)  # (raises TimeoutError if it expired)

    def _check(self) -> None:
        now = self._loop.time()
        if now >= self.deadline:
            self._handle = None
            self._timeout.reschedule(now)  # expires: the read raises TimeoutError
        else:
            when = self.deadline if self.deadline != math.inf else now + self._idle_s
            self._handle = self._loop.call_at(when, self._check)
