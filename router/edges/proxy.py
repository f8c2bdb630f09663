"""Streaming HTTP pass-through to a replica, with retries before the first byte. HTTP edge.

Rules:

* the response is relayed chunk by chunk as it arrives (no buffering); the
  client's headers are sent only when the replica's first body byte arrives,
  so anything failing before that (connection refused or reset, a pooled
  connection the engine had closed, the replica answering 502, 503 or 504) is
  retried on the next-best replica, once (with no replica left, the replica's
  own 502/503/504 answer is relayed); a stale pooled connection is retried once more on
  the same replica first, transparently;
* after bytes went to the client nothing is retried: an SSE stream gets an
  ``data: {"error": {...}}`` event and closes, other bodies are cut short and
  the connection closed (the client sees a short body, never a silent success);
* connect, first-byte and stream-idle timeouts (``RouterConfig``);
* every attempt's outcome feeds the replica's circuit breaker (``router.decision.health``): a 5xx, a
  failed, timed-out or non-HTTP connection and a broken stream count against it, any other
  answer for it; every attempt is registered with its expected first-byte time (its
  deadline) and reports its bytes, and ``abort_waiting`` / ``abort_attempt`` move attempts
  still waiting for a first byte from a replica found stalled or hung, or past their deadline,
  to the next replica;
* the client disconnecting (the aiohttp handler is cancelled) closes the
  upstream connection, which makes vLLM abort the request; it counts against the replica only
  when it waited for a first byte far past the replica's expected time
  (``ReplicaHealth.gave_up``);
* hop-by-hop headers are dropped both ways, and so is every header a ``Connection`` header
  names (RFC 9110 section 7.6.1: those are meant for the next hop only); everything else
  (Authorization, Content-Encoding, ...) passes; bodies are not decompressed.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router.apis.error_shapes import SSE_ERROR_EVENTS, UPSTREAM_ERROR_BODIES
from router.decision.health import HUNG, MISSED, ReplicaHealth
from router.edges.auth import TENANT_KEY, X_API_KEY_HEADER
from router.edges.upstream_pool import PooledResponse, UpstreamClientError, UpstreamPool
from router.observability.loop_lag import LoopLag
from router.observability.metrics import RouterMetrics
from router.observability.tracing import Tracing
from router.request.errors import (
    REQUEST_ID_HEADER,
    STATUS_CLIENT_CLOSED,
    RouterOverloaded,
    UpstreamError,
    UpstreamTimeout,
    error_body,
)
from router.request.routing import Target
from router.request.usage import TAIL_BYTES, TAIL_CHUNKS, joined_tail, trim_tail
from router.service.config import RouterConfig
from router.shared.contract import DP_RANK_HEADER

logger = logging.getLogger(__name__)

REPLICA_HEADER: Final = "x-prefix-router-replica"
REASON_HEADER: Final = "x-prefix-router-reason"
# tokens of the prompt the index had engine-confirmed on the replica that answered (replay records
# compare it with the engine's cached_tokens: the coarse index's over-estimation)
HIT_HEADER: Final = "x-prefix-router-confirmed-hit-tokens"
HEAD_BYTES: Final = 512  # of an answer kept in ProxyOutcome.head
HOP_BY_HOP: Final = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})
# answered before any byte: try the next replica (vLLM answers 500 for an engine failure, which
# another replica need not share; a request it cannot serve is a 4xx)
RETRY_STATUSES: Final = frozenset({500, 502, 503, 504})
# failures that say the replica cannot take connections or does not speak HTTP (it is benched for
# a few seconds); a connection it dropped or a 502/503/504 it answered may be about one request
SUSPECT_CAUSES: Final = frozenset({"connect_error", "connect_refused", "connect_timeout",
                                   "bad_response"})
# the replica left the fleet (its heartbeat expired) while requests waited there for a first
# byte: nothing judges its deadlines any more, so the health watcher moves them
GONE: Final = "replica_gone"
# causes the health watcher counted when it moved the attempt (``Proxy.abort_waiting``)
COUNTED_CAUSES: Final = frozenset({"stalled", HUNG, MISSED, GONE})
# failures that are timeouts measured on the router's loop: not counted when it ran late
TIMED_CAUSES: Final = frozenset({"connect_timeout", "first_byte_timeout"})
# a connect timed out by the router's late loop is tried again on the same replica without using
# up the attempt, at most this many times a request (then 503 router_overloaded: a loop this
# starved sheds the request rather than pile up connects)
LATE_CONNECT_RETRIES: Final = 3
OVERLOADED_REASON: Final = "router_overloaded"
OVERLOADED_RETRY_AFTER_S: Final = 1
# a relayed stream's progress (``ReplicaHealth.progress``) is recorded at most this often: the
# stall detector judges over seconds (its deadline floor), and a record per chunk cost a call
PROGRESS_SAMPLE_S: Final = 0.05


class ProxyTicket(Protocol):
    """What the proxy needs of a load hold (``router.decision.load.LoadTicket``)."""

    def first_token(self) -> None: ...

    def finish(self) -> None: ...


@dataclass(slots=True)
class ProxyOutcome:
    """What happened, for metrics: final replica, HTTP status sent, first-byte time."""

    replica_id: str
    status: int
    first_byte_s: float | None = None
    tail: bytes = b""  # the answer's last ``router.request.usage.TAIL_BYTES`` (SSE, or a one-read body)
    head: bytes = b""  # the answer's first ``HEAD_BYTES`` (a Responses answer's id is there)


_DP_RANK: Final = DP_RANK_HEADER.lower()


def target_headers(headers: CIMultiDict[str], target: Target) -> CIMultiDict[str]:
    """``headers`` for one attempt at ``target``: with vLLM's ``X-data-parallel-rank`` set to the
    target's rank when it is one rank of a data-parallel engine (a copy; ``headers`` is shared
    by the attempts of one request)."""
    if target.dp_rank is None:
        return headers
    ranked = headers.copy()
    ranked[DP_RANK_HEADER] = str(target.dp_rank)
    return ranked


def connect_refused(exc: aiohttp.ClientConnectorError) -> bool:
    """Whether a failed connect was refused (ECONNREFUSED: nothing listens on the port)."""
    return exc.os_error.errno == errno.ECONNREFUSED or isinstance(
        exc.os_error, ConnectionRefusedError)


def hop_by_hop(headers: CIMultiDictProxy[str]) -> frozenset[str]:
    """The lower-case names of ``headers`` not to forward: ``HOP_BY_HOP`` and every name the
    ``Connection`` header(s) list (comma-separated tokens; RFC 9110 section 7.6.1)."""
    listed = {token.strip().lower() for value in headers.getall("Connection", ())
              for token in value.split(",")}
    return HOP_BY_HOP | listed


def upstream_headers(request: web.Request, request_id: str) -> CIMultiDict[str]:
    """Client headers minus hop-by-hop ones (``hop_by_hop``), with the request id set. The body
    goes upstream decoded (aiohttp decodes a gzip/deflate request body), so its Content-Encoding
    is dropped. A client's ``X-data-parallel-rank`` is dropped too: the router picks the rank
    (``Target``), and a client's choice would put the request where the index does not expect
    it."""
    headers: CIMultiDict[str] = CIMultiDict()
    # a key the router checked itself (router/auth.py) is the client's secret: it stays here
    authenticated = request.get(TENANT_KEY) is not None
    dropped = hop_by_hop(request.headers)
    for name, value in request.headers.items():
        lower = name.lower()
        if lower not in dropped and lower != "content-encoding" and lower != _DP_RANK and not (
                authenticated and lower in ("authorization", X_API_KEY_HEADER)):
            headers.add(name, value)
    headers[REQUEST_ID_HEADER] = request_id
    return headers


class ProxyDispatch(Protocol):
    """What the proxy needs of a request's dispatch record, per attempt
    (``router.request.dispatch.Dispatch``; ``PassthroughDispatch`` for the pooling paths)."""

    def start_ticket(self, replica_id: str) -> ProxyTicket:
        """Count the request's load on ``replica_id`` (released by the proxy)."""
        ...

    def expected_first_byte_s(self, replica_id: str) -> float:
        """Seconds ``replica_id`` should take to the first byte (``math.inf``: no deadline)."""
        ...

    def sent(self, replica_id: str) -> object:
        """The attempt's request is going out to ``replica_id``."""
        ...

    def connect_failed(self, replica_id: str) -> None:
        """``replica_id`` refused or timed out a connection, or did not speak HTTP."""
        ...


@dataclass(slots=True)
class Forward:
    """One request for ``Proxy.forward``: the client's ``request`` (its headers, and the
    response written to it), the upstream ``path`` and ``body``, the ``targets`` in order (the
    first and at most one fallback), the decision's ``reason`` and the ``request_id`` (both
    echoed in headers), ``arrival`` (``time.perf_counter`` when the request came: first-byte
    times and the late-connect deadline), the per-attempt ``dispatch`` record, ``streamed``
    (the client asked for SSE: the stall detector watches it) and ``observe_overhead``
    (``router_overhead_seconds`` observed at each send)."""

    request: web.Request
    path: str
    body: bytes
    targets: Sequence[Target]
    reason: str
    request_id: str
    arrival: float
    dispatch: ProxyDispatch
    streamed: bool = False
    observe_overhead: bool = False


def overloaded(why: str) -> RouterOverloaded:
    """The 503 a router sheds a request with: "router overloaded: ``why``; retry after 1 s",
    with ``Retry-After`` and the reason header ``router_overloaded``."""
    exc = RouterOverloaded(f"router overloaded: {why}; retry after {OVERLOADED_RETRY_AFTER_S} s")
    exc.headers["Retry-After"] = str(OVERLOADED_RETRY_AFTER_S)
    exc.headers[REASON_HEADER] = OVERLOADED_REASON
    return exc


class _Retryable(Exception):
    def __init__(self, cause: str, same_replica: bool = False) -> None:
        super().__init__(cause)
        self.cause = cause
        self.same_replica = same_replica


class Proxy:
    """Forwards requests to replicas over one pooled ``aiohttp.ClientSession``, or over
    ``pool`` (``router.edges.upstream_pool``, ``upstream_client: httptools``) for the replicas
    it serves (plain HTTP)."""

    def __init__(self, session: aiohttp.ClientSession, config: RouterConfig,
                 metrics: RouterMetrics, health: ReplicaHealth,
                 tracing: Tracing | None = None, loop_lag: LoopLag | None = None,
                 pool: UpstreamPool | None = None) -> None:
        self.session = session
        self.pool = pool
        self.loop_lag = loop_lag
        self.config = config
        self.metrics = metrics
        self.health = health
        self.tracing = tracing or Tracing(None)
        # {attempt token: (replica_id, first-byte timeout)} of the attempts waiting for a first
        # byte; ``abort_*`` expire them now and record them in ``_aborted`` so they are
        # retried, not 504
        self._waiting: dict[int, tuple[str, asyncio.Timeout]] = {}
        self._aborted: dict[int, str] = {}  # {id of an aborted timeout: cause}
        # the connect timeout is the session's connector's (router.edges.upstream_connector)
        self._timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=None,
                                              sock_read=None)

    async def forward(self, fwd: Forward) -> tuple[web.StreamResponse, ProxyOutcome]:
        """Send ``fwd.body`` to ``fwd.targets[0]`` (then at most one fallback) and relay the
        answer.

        Per attempt, ``fwd.dispatch`` counts the load (``start_ticket``: the ticket is released
        at the first byte and at the end on every path), gives the replica's expected first-byte
        time (``expected_first_byte_s``, after ``start_ticket``; ``math.inf``: no deadline),
        records the send (``sent``) and hears of a replica that refused or timed out a
        connection (``connect_failed``).
        A connect timed out while the router's own loop ran late (``router_late``) is retried on
        the same replica without using up the attempt, within the request's first-byte deadline
        (``first_byte_timeout_s`` from ``fwd.arrival``) and ``LATE_CONNECT_RETRIES``.
        Raises ``UpstreamError`` (502) / ``UpstreamTimeout`` (504) when nothing
        was sent to the client, ``RouterOverloaded`` (503, ``Retry-After``) when late connects
        used up the late retries or the deadline.
        """
        request, path, body, reason = fwd.request, fwd.path, fwd.body, fwd.reason
        request_id, arrival, dispatch = fwd.request_id, fwd.arrival, fwd.dispatch
        overhead = (self.metrics.child(self.metrics.overhead, path) if fwd.observe_overhead
                    else None)
        headers = upstream_headers(request, request_id)
        attempts = list(fwd.targets[:2])
        stale_retry_used = False
        late_retries = 0
        failures: list[str] = []  # every attempt's failure, in order: the 502 names them all
        health = self.health
        i = 0
        while i < len(attempts):
            target = attempts[i]
            rid = target.replica_id
            ticket = dispatch.start_ticket(rid)
            now = time.monotonic()
            token = health.attempt_started(rid, now, fwd.streamed,
                                           dispatch.expected_first_byte_s(rid),
                                           fallback=i + 1 < len(attempts))
            try:
                if overhead is not None:
                    overhead.observe(time.perf_counter() - arrival)
                dispatch.sent(rid)
                if self.tracing.enabled:  # (off: no span, no attributes built)
                    result = await self._traced_attempt(fwd, headers, target, ticket, token,
                                                        i + 1, i + 1 < len(attempts))
                else:
                    result = await self._attempt(request, path, body, headers, target, reason,
                                                 request_id, ticket, arrival, token,
                                                 retry_status=i + 1 < len(attempts))
            except _Retryable as exc:
                ticket.finish()
                failures.append(f"replica {rid}: {exc.cause}")
                if exc.same_replica and not stale_retry_used:
                    stale_retry_used = True
                    self.metrics.child(self.metrics.retries, "stale_connection").inc()
                    continue
                if self.router_late(exc.cause, now):
                    # the replica may well have answered: nothing against it; a connect that
                    # never had its time is not the replica's attempt either
                    if exc.cause == "connect_timeout":
                        late_retries += 1
                        self._late_connect(late_retries, arrival, request_id, rid)
                        continue
                elif exc.cause not in COUNTED_CAUSES:  # counted once, when found
                    if exc.cause in SUSPECT_CAUSES:
                        dispatch.connect_failed(rid)
                    if exc.cause == "connect_refused":
                        health.record_refused(rid, time.monotonic())
                    self._failed(rid, exc.cause)
                if i + 1 < len(attempts):
                    self.metrics.child(self.metrics.retries, exc.cause).inc()
                    logger.info("retrying %s elsewhere after %s", request_id, failures[-1])
                i += 1
                continue
            except (UpstreamError, UpstreamTimeout) as exc:  # first-byte timeout or another client error
                ticket.finish()
                cause = "first_byte_timeout" if isinstance(exc, UpstreamTimeout) else "client_error"
                if not self.router_late(cause, now):
                    self._failed(rid, cause)
                raise
            except BaseException as exc:
                ticket.finish()
                if isinstance(exc, asyncio.CancelledError) and health.gave_up(
                        rid, token, time.monotonic()):
                    self._failed(rid, "client_gave_up")
                raise
            finally:
                health.attempt_ended(rid, token)
            ticket.finish()
            status = result[1].status
            if status == STATUS_CLIENT_CLOSED:
                pass  # the client went away: nothing said about the replica
            elif status >= 500:  # a relayed 5xx, or the stream failed after its first byte
                health.record_failure(rid, time.monotonic(), f"http_{status}")
            else:
                health.record_success(rid, now, served=200 <= status < 300)
            return result
        # the first attempt is the one x-prefix-router-replica names; list every one so the
        # message never contradicts the header
        tried = "; then ".join(failures) or "no replica"
        raise UpstreamError(f"upstream failed before the first byte: {tried}")

    async def _traced_attempt(self, fwd: Forward, headers: CIMultiDict[str], target: Target,
                              ticket: ProxyTicket, token: int, attempt: int,
                              retry_status: bool) -> tuple[web.StreamResponse, ProxyOutcome]:
        """``_attempt`` in one CLIENT span; its context goes upstream as traceparent."""
        with self.tracing.client_span("upstream", headers, {
                "prefix_router.replica": target.replica_id, "server.address": target.url,
                "url.path": fwd.path, "prefix_router.attempt": attempt}) as span:
            result = await self._attempt(fwd.request, fwd.path, fwd.body, headers, target,
                                         fwd.reason, fwd.request_id, ticket, fwd.arrival, token,
                                         retry_status=retry_status)
            span.set_attribute("http.response.status_code", result[1].status)
            return result

    def router_late(self, cause: str, since: float) -> bool:
        """Whether a ``cause`` failure of an attempt sent at ``since`` (monotonic) is a timeout
        the router's own loop made (``router.observability.loop_lag``: it ran late over the attempt's span);
        counted in ``router_loop_late_verdicts_total``, never against the replica."""
        if cause not in TIMED_CAUSES or self.loop_lag is None or not self.loop_lag.late(
                since, time.monotonic()):
            return False
        self.metrics.child(self.metrics.loop_late, cause).inc()
        return True

    def _late_connect(self, late_retries: int, arrival: float, request_id: str,
                      replica_id: str) -> None:
        """Allow the ``late_retries``-th retry of a connect the router's late loop timed out
        (counted as ``router_upstream_retries_total{cause="router_late"}``), or raise
        ``RouterOverloaded`` when the retries or the request's first-byte deadline
        (``arrival``: ``time.perf_counter``) are used up."""
        cfg = self.config
        left_s = cfg.first_byte_timeout_s - (time.perf_counter() - arrival)
        if late_retries <= LATE_CONNECT_RETRIES and left_s > cfg.connect_timeout_s:
            self.metrics.child(self.metrics.retries, "router_late").inc()
            logger.info("retrying %s on %s: the router's loop ran late over its connect",
                        request_id, replica_id)
            return
        raise overloaded(f"its event loop ran too late to connect to replica {replica_id} "
                         f"({late_retries} connects timed out on it)")

    def _failed(self, replica_id: str, cause: str) -> None:
        self.metrics.child(self.metrics.upstream_errors, replica_id, cause).inc()
        if self.health.record_failure(replica_id, time.monotonic(), cause):
            logger.warning("replica %s: circuit opened after %s", replica_id, cause)

    def waiting_replicas(self) -> set[str]:
        """The replicas that requests are waiting on for a first byte now."""
        return {rid for rid, _ in self._waiting.values()}

    def abort_waiting(self, replica_id: str, cause: str = "stalled") -> int:
        """Make the attempts waiting for a first byte from ``replica_id`` give up now and go to
        their next replica (a stalled or hung replica). Returns how many there were."""
        tokens = [t for t, (rid, _) in self._waiting.items() if rid == replica_id]
        for token in tokens:
            self.abort_attempt(token, cause)
        return len(tokens)

    def abort_attempt(self, token: int, cause: str) -> bool:
        """Make the attempt ``token`` (``ReplicaHealth.attempt_started``) give up waiting for its
        first byte now and go to its next replica. False if it no longer waits."""
        waiting = self._waiting.get(token)
        if waiting is None:
            return False
        cm = waiting[1]
        self._aborted[id(cm)] = cause
        cm.reschedule(asyncio.get_running_loop().time())
        return True

    async def _attempt(
        self,
        request: web.Request,
        path: str,
        body: bytes,
        headers: CIMultiDict[str],
        target: Target,
        reason: str,
        request_id: str,
        ticket: ProxyTicket,
        arrival: float,
        token: int,
        retry_status: bool = True,
    ) -> tuple[web.StreamResponse, ProxyOutcome]:
        """One attempt (``token``: its ``ReplicaHealth`` registration); ``retry_status`` False
        relays a 502/503/504 answer instead of retrying."""
        cfg = self.config
        timeout = self._timeout
        upstream: aiohttp.ClientResponse | PooledResponse | None = None
        first_byte = asyncio.timeout(cfg.first_byte_timeout_s)
        pool = self.pool
        try:
            try:
                async with first_byte:
                    self._waiting[token] = (target.replica_id, first_byte)
                    if pool is not None and pool.handles(target.url):
                        upstream = await pool.request(request.method, target.url, path, body,
                                                      target_headers(headers, target))
                    else:
                        upstream = await self.session.request(
                            request.method, f"{target.url}{path}", data=body or None,
                            headers=target_headers(headers, target), timeout=timeout,
                            auto_decompress=False, allow_redirects=False)
                    if retry_status and upstream.status in RETRY_STATUSES:
                        raise _Retryable(f"http_{upstream.status}")
                    first = await upstream.content.readany()
            except UpstreamClientError as exc:  # the httptools pool's, named by their cause
                raise _Retryable(exc.cause, same_replica=exc.cause == "disconnected") from exc
            except aiohttp.ClientConnectorError as exc:
                # refused (nothing listens: the replica is down) apart from the other connect
                # errors (unreachable host, DNS), which a busy network can cause
                raise _Retryable("connect_refused" if connect_refused(exc)
                                 else "connect_error") from exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                raise _Retryable("disconnected", same_replica=True) from exc
            except aiohttp.ServerTimeoutError as exc:
                raise _Retryable("connect_timeout") from exc
            except aiohttp.ClientPayloadError as exc:
                raise _Retryable("payload_error") from exc
            except aiohttp.ClientResponseError as exc:  # not HTTP: a bad status line or headers
                raise _Retryable("bad_response") from exc
            except TimeoutError as exc:
                if id(first_byte) in self._aborted:
                    raise _Retryable(self._aborted[id(first_byte)]) from exc
                raise UpstreamTimeout(
                    f"replica {target.replica_id} sent no byte within "
                    f"{cfg.first_byte_timeout_s:g} s") from exc
            except aiohttp.ClientError as exc:
                raise UpstreamError(f"replica {target.replica_id}: {exc}") from exc
            finally:
                self._waiting.pop(token, None)
                self._aborted.pop(id(first_byte), None)
            self.health.first_byte(target.replica_id, token, time.monotonic())
            first_byte_s = time.perf_counter() - arrival
            ticket.first_token()
            out_headers: CIMultiDict[str] = CIMultiDict()
            dropped = hop_by_hop(upstream.headers)
            for name, value in upstream.headers.items():
                if name.lower() not in dropped:
                    out_headers.add(name, value)
            out_headers[REPLICA_HEADER] = target.replica_id
            out_headers[REASON_HEADER] = reason
            out_headers[HIT_HEADER] = str(target.confirmed_hit_tokens)
            out_headers[REQUEST_ID_HEADER] = request_id
            outcome = ProxyOutcome(target.replica_id, upstream.status, first_byte_s,
                                   head=first[:HEAD_BYTES])
            whole = upstream.content_length is not None and len(first) == upstream.content_length
            response: web.StreamResponse
            try:
                if whole:
                    # the whole (non-streamed) body came in the first read: one write, headers
                    # and body together
                    outcome.tail = first[-TAIL_BYTES:]  # the usage, for the template audit
                    reshape = UPSTREAM_ERROR_BODIES.get(path)
                    if reshape is not None and upstream.status >= 400 and (
                            "content-encoding" not in upstream.headers):
                        first = reshape(first, upstream.status)  # the API's own error shape
                    response = web.Response(status=upstream.status, reason=upstream.reason,
                                            body=first, headers=out_headers)
                    await response.prepare(request)
                    await response.write_eof()
                else:
                    response = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                                  headers=out_headers)
                    if upstream.content_length is not None:
                        response.content_length = upstream.content_length
                    await response.prepare(request)
                    if first:
                        await response.write(first)
                    await self._relay(upstream, response, target, outcome, path, first)
            except ConnectionResetError:
                # the client went away between two chunks (aiohttp raises on the write rather
                # than cancelling the handler): same outcome as a cancelled request
                logger.info("client closed %s mid-response from %s", request_id, target.replica_id)
                outcome.status = STATUS_CLIENT_CLOSED
            return response, outcome
        except asyncio.CancelledError:
            logger.info("client closed %s; cancelling upstream on %s", request_id, target.replica_id)
            raise
        finally:
            if upstream is not None:
                if upstream.content.at_eof() and not upstream.closed:
                    upstream.release()
                else:
                    upstream.close()  # drop the connection so the engine aborts the request

    async def _relay(self, upstream: aiohttp.ClientResponse | PooledResponse, response: web.StreamResponse,
                     target: Target, outcome: ProxyOutcome, path: str = "",
                     first: bytes = b"") -> None:
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
        rid = target.replica_id
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
