"""The pooling, scoring and tokenizer paths and Anthropic ``count_tokens``
(``router.apis.pooling``): forwarded to the least-loaded replica serving the request's model, an
alias rewritten to its served model first, the pooling paths under the tenant's ``cache_salt``;
and a stored Responses answer's retrieve and cancel, forwarded to the replica holding it. HTTP
edge.
"""

from __future__ import annotations

import time

from aiohttp import web

from router.apis.aliases import AliasTable
from router.apis.pooling import POOLING_PATHS, SALTED_PATHS, input_tokens, request_model
from router.edges.auth import TENANT_KEY
from router.edges.http_errors import REQUEST_ID_KEY
from router.edges.proxy import Forward, Proxy
from router.observability.metrics import RouterMetrics
from router.request.body import RequestBody
from router.request.dispatch import Dispatcher
from router.request.errors import RouterError
from router.request.routing import RequestRouter, Target
from router.service.request_parse import RequestParser
from router.service.response_holders import ResponseHolders
from router.traffic.rate_limits import TenantRateLimits

STORED_RESPONSE_REASON = "stored_response"  # retrieve / cancel: the holder, nothing chosen


class PassthroughHandler:
    """``handle_passthrough(request)`` and ``handle_stored_response(request)``; ``proxy`` is
    set when the router starts. Each attempt's load ticket, first-byte deadline and connect
    failure go through ``dispatcher.passthrough()``; an answer's time teaches the deadline of
    the next. The pooling and scoring paths count against their tenant's rate limits
    (``rate_limits``) as generation does, their tokens estimated (``input_tokens``); the
    tokenizer paths do not (no engine work beyond a tokenizer call)."""

    def __init__(self, parser: RequestParser, aliases: AliasTable, router: RequestRouter,
                 dispatcher: Dispatcher, metrics: RouterMetrics,
                 holders: ResponseHolders, rate_limits: TenantRateLimits) -> None:
        self.parser = parser
        self.rate_limits = rate_limits
        self.aliases = aliases
        self.router = router
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.holders = holders
        self.proxy: Proxy | None = None

    async def handle_passthrough(self, request: web.Request) -> web.StreamResponse:
        """Forward the request to the least-loaded replica serving its model; counted in
        ``router_requests_total``. Raises ``BadRequest`` for a body that is not JSON (or a
        client's own ``cache_salt`` on a pooling path under the ``reject`` policy),
        ``RateLimited`` (429) for a pooling or scoring request over its tenant's limits."""
        arrival = time.perf_counter()
        try:
            body = await self.parser.read(request)
            data = body.data()
            model = request_model(data)
            self._salt(request, body)
            if request.path in POOLING_PATHS and self.rate_limits.enabled:
                await self.rate_limits.check(request.get(TENANT_KEY) or "", input_tokens(data))
            target = self.aliases.resolve(model) if model is not None else None
            if target is not None:
                body.set("model", target)
                model = target
            decision, targets = self.router.least_loaded(model)
        except RouterError as exc:  # refused before any replica: counted as generation's are
            self.metrics.requests.labels("", "none", request.path, str(exc.status)).inc()
            raise
        return await self._forward(request, request.path, body.encoded(), targets,
                                   decision.replica_id, decision.reason, arrival)

    def _salt(self, request: web.Request, body: RequestBody) -> None:
        """A pooling request's ``cache_salt`` set to its tenant's (API keys on), by the
        generate path's rules (``TenantAuth.check_client_salt``): vLLM 0.32 reads the prefix
        cache for pooling too, so an unsalted request would share blocks across tenants."""
        auth = self.parser.auth
        if auth is None or request.path not in SALTED_PATHS:
            return
        salt = auth.request_salt(request)
        if salt is not None:
            auth.check_client_salt(body.data().get("cache_salt"))
            body.set("cache_salt", salt)

    async def handle_stored_response(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``: to the replica
        holding the tenant's response. Raises ``ResponseNotFound`` (404: unknown, another
        tenant's, or its replica left the fleet), ``NoRoutableReplica`` (503)."""
        arrival = time.perf_counter()
        resource = request.match_info.route.resource
        # the route's template, not the path: one series, not one per response id
        endpoint = resource.canonical if resource is not None else request.path
        try:
            body = (await self.parser.read(request)).raw if request.method == "POST" else b""
            target = await self.holders.target(request.match_info["response_id"],
                                               request.get(TENANT_KEY))
        except RouterError as exc:
            self.metrics.requests.labels("", "none", endpoint, str(exc.status)).inc()
            raise
        return await self._forward(request, request.path_qs, body, [target], target.replica_id,
                                   STORED_RESPONSE_REASON, arrival, endpoint)

    async def _forward(self, request: web.Request, path: str, body: bytes,
                       targets: list[Target], replica_id: str, reason: str, arrival: float,
                       endpoint: str | None = None) -> web.StreamResponse:
        assert self.proxy is not None
        status = 500
        dispatch = self.dispatcher.passthrough()
        try:
            response, outcome = await self.proxy.forward(Forward(
                request, path, body, targets, reason, request[REQUEST_ID_KEY], arrival,
                dispatch))
            status = outcome.status
            if status == 200 and outcome.first_byte_s is not None:  # its first-byte deadline
                dispatch.observe_answer(outcome.replica_id, arrival + outcome.first_byte_s)
            return response
        except RouterError as exc:
            status = exc.status
            raise
        finally:
            self.metrics.requests.labels(replica_id, reason, endpoint or request.path,
                                         str(status)).inc()
