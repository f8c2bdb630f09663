"""The generate APIs' handler (completions, chat, Responses, Messages): the request path from the
body to the proxy, in order: parse (``request_parse``), admission (``fleet_admission``), the
prompt chain and the decision (``router.request.routing``), the dispatch record
(``router.request.dispatch``), the proxy; then what the answer teaches (``learning``). HTTP
edge; each step lives in its own module, so that the walk of a request visits each once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Final

from aiohttp import web

from router.edges.auth import TENANT_KEY
from router.edges.http_errors import REQUEST_ID_KEY
from router.edges.proxy import (
    OVERLOADED_REASON,
    REASON_HEADER,
    REPLICA_HEADER,
    Forward,
    Proxy,
    overloaded,
)
from router.observability.loop_lag import LoopLag
from router.observability.metrics import RouterMetrics
from router.request.dispatch import Dispatcher
from router.request.errors import STATUS_CLIENT_CLOSED, RouterError
from router.request.routing import RequestRouter
from router.service.fleet_admission import FleetAdmission
from router.service.learning import RequestLearning
from router.service.request_parse import API_PATHS, RequestParser
from router.service.response_holders import ResponseHolders
from router.traffic.sessions import SESSION_HEADER

GENERATE_PATHS: Final = frozenset({"/v1/completions", "/v1/chat/completions",
                                   *API_PATHS.values()})


@dataclass(slots=True)
class _Counted:
    """What ``router_requests_total`` records of one request (filled in as it goes)."""

    endpoint: str
    replica_id: str = ""  # "" when no replica was chosen (the router answered itself)
    reason: str = "none"
    status: int = 500


class GenerateHandler:
    """``handle_generate(kind, request)`` for the four generate APIs; ``proxy`` is set when
    the router starts (it needs the running loop's client session).

    Shedding: while ``loop_lag`` shows the router's loop late for most of the last second with
    its timers falling due late (``LoopLag.overloaded``) and at least ``shed_min_inflight``
    requests are in flight here (the new one included; 0: never), a new request is answered 503
    ``router_overloaded`` with ``Retry-After`` before its body is read: its connects would only
    time out on the late loop."""

    def __init__(self, parser: RequestParser, admission: FleetAdmission, router: RequestRouter,
                 holders: ResponseHolders, dispatcher: Dispatcher, learning: RequestLearning,
                 metrics: RouterMetrics, loop_lag: LoopLag | None = None,
                 shed_min_inflight: int = 0) -> None:
        self.parser = parser
        self.admission = admission
        self.router = router
        self.holders = holders
        self.dispatcher = dispatcher
        self.learning = learning
        self.metrics = metrics
        self.loop_lag = loop_lag
        self.shed_min_inflight = shed_min_inflight
        self.num_inflight = 0  # generate requests in this handler now
        self.proxy: Proxy | None = None

    async def handle_generate(self, kind: str, request: web.Request) -> web.StreamResponse:
        """Completions and chat (``kind`` "completion", "chat"), Responses and Messages: every
        outcome, the router's own errors included, is counted in ``router_requests_total``;
        errors after a decision carry the routing headers."""
        counted = _Counted(request.path)
        self.num_inflight += 1
        try:
            self._shed_if_late(counted)
            return await self._generate(kind, request, counted)
        except RouterError as exc:
            counted.status = exc.status
            if counted.replica_id:
                exc.headers.setdefault(REPLICA_HEADER, counted.replica_id)
                exc.headers.setdefault(REASON_HEADER, counted.reason)
            raise
        except web.HTTPException as exc:  # 413 from aiohttp's body limit
            counted.status = exc.status
            raise
        except asyncio.CancelledError:
            counted.status = STATUS_CLIENT_CLOSED
            raise
        finally:
            self.num_inflight -= 1
            self.metrics.child(self.metrics.requests, counted.replica_id, counted.reason,
                               counted.endpoint, str(counted.status)).inc()

    def _shed_if_late(self, counted: _Counted) -> None:
        """Raise the 503 ``router_overloaded`` (counted with that reason) when the class
        docstring's shedding rule holds."""
        floor, lag = self.shed_min_inflight, self.loop_lag
        if floor and lag is not None and self.num_inflight >= floor and lag.overloaded(
                time.monotonic()):
            counted.reason = OVERLOADED_REASON
            raise overloaded("its event loop ran late for most of the last second with "
                             f"{self.num_inflight} requests in flight")

    def refused_unread(self, request: web.Request, status: int) -> None:
        """A generate request refused before its handler ran (a declared body over
        ``max_body_bytes``) is counted in ``router_requests_total`` as the handler counts it."""
        if request.path in GENERATE_PATHS:
            self.metrics.child(self.metrics.requests, "", "none", request.path, str(status)).inc()

    async def _generate(self, kind: str, request: web.Request,
                        counted: _Counted) -> web.StreamResponse:
        """The request path: parse -> admission -> prompt chain and routing -> dispatch record
        -> proxy -> learning."""
        arrival = time.perf_counter()
        parsed = await self.parser.parse(kind, request)  # 1. parse (and a request's template)
        slot = await self.admission.admit(parsed, request)  # 2. rate limits (429), room (503)
        spec, continued = parsed.spec, parsed.responses
        try:  # 3. the prompt's chain, the decision (among the replicas with room)
            if continued is not None and continued.previous_response_id is not None:
                routed = await self.holders.route(continued.previous_response_id, spec,
                                                  request.get(TENANT_KEY))
            else:
                routed = await self.router.route(spec, has_room=self.admission.room_check(),
                                                 session_id=request.headers.get(SESSION_HEADER))
        except BaseException:
            slot.release()
            raise
        decision = routed.decision
        counted.replica_id, counted.reason = decision.replica_id, decision.reason
        dispatch = self.dispatcher.begin(routed, spec)  # 4. owns tickets, placements, writes
        status, replica_id = 500, decision.replica_id
        assert self.proxy is not None
        try:
            slot.dispatched()  # counted in the replica's load from the proxy's first step on
            response, outcome = await self.proxy.forward(Forward(  # 5. proxy
                request, request.path, parsed.body.encoded(), routed.targets, decision.reason,
                request[REQUEST_ID_KEY], arrival, dispatch, streamed=spec.stream,
                observe_overhead=True))
            status, replica_id = outcome.status, outcome.replica_id
            counted.status, counted.replica_id = status, replica_id
            # nothing awaited from here on: the answer is delivered, and a client that hangs up
            # now cancels this handler at its next await (it counted 499 and skipped these)
            if continued is not None and continued.store and status == 200:
                self.holders.remember(outcome, request.get(TENANT_KEY))
            if status == 200:
                self.router.served(routed, replica_id)
            self.learning.observe(spec, routed, dispatch, outcome, arrival,
                                  request.get(TENANT_KEY))  # 6. what the answer teaches
            return response
        except RouterError as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = STATUS_CLIENT_CLOSED
            raise
        finally:
            dispatch.settle(status, replica_id)
            slot.release()
