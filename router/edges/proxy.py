"""Streaming HTTP pass-through to a replica, with retries before the first byte. HTTP edge.

Rules:

* the client's headers are sent only when the replica's first body byte arrives,
  so anything failing before that (connection refused or reset, a pooled
  connection the engine had closed, the replica answering 502, 503 or 504) is
  retried on the next-best replica, once (with no replica left, the replica's
  own 502/503/504 answer is relayed); a stale pooled connection is retried once more on
  the same replica first, transparently;
* from the first byte on, ``router.edges.relay`` relays the answer chunk by chunk (no
  buffering) and nothing is retried: an SSE stream that breaks gets an
  ``data: {"error": {...}}`` event and closes, other bodies are cut short and
  the connection closed (the client sees a short body, never a silent success);
* connect, first-byte and stream-idle timeouts (``RouterConfig``);
* every attempt's outcome feeds the replica's circuit breaker (``router.decision.health``): a 5xx, a
  failed, timed-out or non-HTTP connection and a broken stream count against it, any other
  answer for it; every attempt is registered with its expected first-byte time (its
  deadline) and reports its bytes, and waits in ``Proxy.waits``
  (``router.edges.first_byte_waits``) for its first byte, from where the stall watch moves
  attempts waiting on a replica found stalled or hung, or past their deadline, to the next
  replica;
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
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router.decision.health import HUNG, MISSED, ReplicaHealth
from router.edges.auth import TENANT_KEY, X_API_KEY_HEADER
from router.edges.first_byte_waits import GONE, FirstByteWaits
from router.edges.relay import ProxyOutcome, Relay, UpstreamResponse
from router.edges.upstream_pool import UpstreamClientError, UpstreamPool
from router.observability.loop_lag import LoopLag
from router.observability.metrics import RouterMetrics
from router.observability.tracing import Tracing
from router.request.errors import (
    REQUEST_ID_HEADER,
    STATUS_CLIENT_CLOSED,
    RouterOverloaded,
    UpstreamError,
    UpstreamTimeout,
)
from router.request.routing import Target
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
# causes the health watcher counted when it moved the attempt (``FirstByteWaits.abort_waiting``;
# ``GONE``: the replica left the fleet)
COUNTED_CAUSES: Final = frozenset({"stalled", HUNG, MISSED, GONE})
# failures that are timeouts measured on the router's loop: not counted when it ran late
TIMED_CAUSES: Final = frozenset({"connect_timeout", "first_byte_timeout"})
# a connect timed out by the router's late loop is tried again on the same replica without using
# up the attempt, at most this many times a request (then 503 router_overloaded: a loop this
# starved sheds the request rather than pile up connects)
LATE_CONNECT_RETRIES: Final = 3
OVERLOADED_REASON: Final = "router_overloaded"
OVERLOADED_RETRY_AFTER_S: Final = 1


class ProxyTicket(Protocol):
    """What the proxy needs of a load hold (``router.decision.load.LoadTicket``)."""

    def first_token(self) -> None: ...

    def finish(self) -> None: ...


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


def answer_headers(upstream: UpstreamResponse, target: Target, reason: str,
                   request_id: str) -> CIMultiDict[str]:
    """The answer's headers to the client: the replica's minus hop-by-hop ones (``hop_by_hop``),
    with the replica that answered, the decision's ``reason``, the index's confirmed hit there
    (``HIT_HEADER``) and the request id set."""
    headers: CIMultiDict[str] = CIMultiDict()
    dropped = hop_by_hop(upstream.headers)
    for name, value in upstream.headers.items():
        if name.lower() not in dropped:
            headers.add(name, value)
    headers[REPLICA_HEADER] = target.replica_id
    headers[REASON_HEADER] = reason
    headers[HIT_HEADER] = str(target.confirmed_hit_tokens)
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


@dataclass(slots=True)
class _Retries:
    """A request's retries so far (made at its first failure): every failed attempt's
    ``failures``, in order (the 502 names them all), whether the one retry of a stale pooled
    connection is used, and the connects the router's late loop timed out."""

    failures: list[str] = field(default_factory=list)
    stale_retry_used: bool = False
    late_retries: int = 0


class Proxy:
    """Forwards requests to replicas over one pooled ``aiohttp.ClientSession``, or over
    ``pool`` (``router.edges.upstream_pool``, ``upstream_client: httptools``) for the replicas
    it serves (plain HTTP). ``waits``: its attempts waiting for a first byte (the stall watch
    moves them); ``relay``: what writes an answer to the client once its first byte came."""

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
        self.waits = FirstByteWaits()
        self.relay = Relay(config, metrics, health)
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
        connection (``connect_failed``). What is retried, and where: ``_retry_same``.
        Raises ``UpstreamError`` (502) / ``UpstreamTimeout`` (504) when nothing
        was sent to the client, ``RouterOverloaded`` (503, ``Retry-After``) when late connects
        used up the late retries or the deadline.
        """
        dispatch, health = fwd.dispatch, self.health
        overhead = (self.metrics.child(self.metrics.overhead, fwd.path) if fwd.observe_overhead
                    else None)
        headers = upstream_headers(fwd.request, fwd.request_id)
        attempts = list(fwd.targets[:2])
        retries: _Retries | None = None
        i = 0
        while i < len(attempts):
            target = attempts[i]
            rid = target.replica_id
            fallback = i + 1 < len(attempts)
            ticket = dispatch.start_ticket(rid)
            now = time.monotonic()
            token = health.attempt_started(rid, now, fwd.streamed,
                                           dispatch.expected_first_byte_s(rid), fallback=fallback)
            try:
                if overhead is not None:
                    overhead.observe(time.perf_counter() - fwd.arrival)
                dispatch.sent(rid)
                if self.tracing.enabled:  # (off: no span, no attributes built)
                    result = await self._traced_attempt(fwd, headers, target, ticket, token,
                                                        i + 1, fallback)
                else:
                    result = await self._attempt(fwd, headers, target, ticket, token, fallback)
            except _Retryable as exc:
                ticket.finish()
                retries = retries or _Retries()
                if not self._retry_same(exc, retries, fwd, rid, now, fallback):
                    i += 1
                continue
            except BaseException as exc:
                ticket.finish()
                self._gave_up(exc, rid, token, now)
                raise
            finally:
                health.attempt_ended(rid, token)
            ticket.finish()
            self._answered(rid, now, result[1].status)
            return result
        # the first attempt is the one x-prefix-router-replica names; list every one so the
        # message never contradicts the header
        tried = "; then ".join(retries.failures) if retries else "no replica"
        raise UpstreamError(f"upstream failed before the first byte: {tried}")

    def _retry_same(self, exc: _Retryable, retries: _Retries, fwd: Forward, rid: str,
                    now: float, fallback: bool) -> bool:
        """After the attempt at ``rid`` sent at ``now`` (monotonic) failed with ``exc`` before
        its first byte: True to try ``rid`` again, without using up the attempt (a stale pooled
        connection, once a request; a connect timed out while the router's own loop ran late
        (``router_late``), within the request's first-byte deadline (``first_byte_timeout_s``
        from ``fwd.arrival``) and ``LATE_CONNECT_RETRIES``); else False, the failure counted
        against the replica unless the router was late or the stall watch counted it, and the
        next target (``fallback``) is tried. Raises ``RouterOverloaded`` when late connects used
        up the late retries or the deadline."""
        retries.failures.append(f"replica {rid}: {exc.cause}")
        if exc.same_replica and not retries.stale_retry_used:
            retries.stale_retry_used = True
            self.metrics.child(self.metrics.retries, "stale_connection").inc()
            return True
        if self.router_late(exc.cause, now):
            # the replica may well have answered: nothing against it; a connect that
            # never had its time is not the replica's attempt either
            if exc.cause == "connect_timeout":
                retries.late_retries += 1
                self._late_connect(retries.late_retries, fwd.arrival, fwd.request_id, rid)
                return True
        elif exc.cause not in COUNTED_CAUSES:  # counted once, when found
            if exc.cause in SUSPECT_CAUSES:
                fwd.dispatch.connect_failed(rid)
            if exc.cause == "connect_refused":
                self.health.record_refused(rid, time.monotonic())
            self._failed(rid, exc.cause)
        if fallback:
            self.metrics.child(self.metrics.retries, exc.cause).inc()
            logger.info("retrying %s elsewhere after %s", fwd.request_id, retries.failures[-1])
        return False

    def _gave_up(self, exc: BaseException, rid: str, token: int, now: float) -> None:
        """The attempt at ``rid`` sent at ``now`` ended in ``exc``, not to be retried: a
        first-byte timeout or another client error counts against the replica (unless the
        router's loop ran late), and so does a client that gave up waiting far past the
        replica's expected time (``ReplicaHealth.gave_up``)."""
        if isinstance(exc, UpstreamError | UpstreamTimeout):
            cause = "first_byte_timeout" if isinstance(exc, UpstreamTimeout) else "client_error"
            if not self.router_late(cause, now):
                self._failed(rid, cause)
        elif isinstance(exc, asyncio.CancelledError) and self.health.gave_up(
                rid, token, time.monotonic()):
            self._failed(rid, "client_gave_up")

    def _answered(self, rid: str, now: float, status: int) -> None:
        """The attempt at ``rid`` sent at ``now`` was answered with ``status`` (or the client
        left, ``STATUS_CLIENT_CLOSED``): its circuit breaker hears of it."""
        if status == STATUS_CLIENT_CLOSED:
            pass  # the client went away: nothing said about the replica
        elif status >= 500:  # a relayed 5xx, or the stream failed after its first byte
            self.health.record_failure(rid, time.monotonic(), f"http_{status}")
        else:
            self.health.record_success(rid, now, served=200 <= status < 300)

    async def _traced_attempt(self, fwd: Forward, headers: CIMultiDict[str], target: Target,
                              ticket: ProxyTicket, token: int, attempt: int,
                              retry_status: bool) -> tuple[web.StreamResponse, ProxyOutcome]:
        """``_attempt`` in one CLIENT span; its context goes upstream as traceparent."""
        with self.tracing.client_span("upstream", headers, {
                "prefix_router.replica": target.replica_id, "server.address": target.url,
                "url.path": fwd.path, "prefix_router.attempt": attempt}) as span:
            result = await self._attempt(fwd, headers, target, ticket, token, retry_status)
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

    async def _attempt(self, fwd: Forward, headers: CIMultiDict[str], target: Target,
                       ticket: ProxyTicket, token: int,
                       retry_status: bool) -> tuple[web.StreamResponse, ProxyOutcome]:
        """One attempt (``token``: its ``ReplicaHealth`` registration): the request sent and its
        first byte awaited (registered in ``waits`` meanwhile), then the answer relayed
        (``relay``). ``retry_status`` False relays a 500/502/503/504 answer instead of
        retrying. Raises ``_Retryable`` for a failure before the first byte that another
        attempt may not share (``_failure``)."""
        upstream: UpstreamResponse | None = None
        first_byte = asyncio.timeout(self.config.first_byte_timeout_s)
        pool, waits = self.pool, self.waits
        try:
            try:
                async with first_byte:
                    waits.start(token, target.replica_id, first_byte)
                    if pool is not None and pool.handles(target.url):
                        upstream = await pool.request(fwd.request.method, target.url, fwd.path,
                                                      fwd.body, target_headers(headers, target))
                    else:
                        upstream = await self.session.request(
                            fwd.request.method, f"{target.url}{fwd.path}", data=fwd.body or None,
                            headers=target_headers(headers, target), timeout=self._timeout,
                            auto_decompress=False, allow_redirects=False)
                    if retry_status and upstream.status in RETRY_STATUSES:
                        raise _Retryable(f"http_{upstream.status}")
                    first = await upstream.content.readany()
            except (aiohttp.ClientError, UpstreamClientError, TimeoutError) as exc:
                raise self._failure(exc, target, waits.aborted(token)) from exc
            finally:
                waits.end(token)
            self.health.first_byte(target.replica_id, token, time.monotonic())
            first_byte_s = time.perf_counter() - fwd.arrival
            ticket.first_token()
            outcome = ProxyOutcome(target.replica_id, upstream.status, first_byte_s,
                                   head=first[:HEAD_BYTES])
            response = await self.relay.answer(
                fwd.request, upstream, answer_headers(upstream, target, fwd.reason, fwd.request_id),
                outcome, fwd.path, first, fwd.request_id)
            return response, outcome
        except asyncio.CancelledError:
            logger.info("client closed %s; cancelling upstream on %s", fwd.request_id,
                        target.replica_id)
            raise
        finally:
            if upstream is not None:
                if upstream.content.at_eof() and not upstream.closed:
                    upstream.release()
                else:
                    upstream.close()  # drop the connection so the engine aborts the request

    def _failure(self, exc: Exception, target: Target, aborted: str | None) -> Exception:
        """What a client error or timeout ``exc`` of an attempt at ``target`` before its first
        byte raises: ``_Retryable`` named by its cause (``aborted``: the cause the stall watch
        gave when it moved the attempt), ``UpstreamTimeout`` for a first-byte timeout, or
        ``UpstreamError``."""
        if isinstance(exc, UpstreamClientError):  # the httptools pool's, named by their cause
            return _Retryable(exc.cause, same_replica=exc.cause == "disconnected")
        if isinstance(exc, aiohttp.ClientConnectorError):
            # refused (nothing listens: the replica is down) apart from the other connect
            # errors (unreachable host, DNS), which a busy network can cause
            return _Retryable("connect_refused" if connect_refused(exc) else "connect_error")
        if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
            return _Retryable("disconnected", same_replica=True)
        if isinstance(exc, aiohttp.ServerTimeoutError):
            return _Retryable("connect_timeout")
        if isinstance(exc, aiohttp.ClientPayloadError):
            return _Retryable("payload_error")
        if isinstance(exc, aiohttp.ClientResponseError):  # not HTTP: a bad status line or headers
            return _Retryable("bad_response")
        if isinstance(exc, TimeoutError):
            if aborted is not None:
                return _Retryable(aborted)
            return UpstreamTimeout(f"replica {target.replica_id} sent no byte within "
                                   f"{self.config.first_byte_timeout_s:g} s")
        return UpstreamError(f"replica {target.replica_id}: {exc}")
