"""The pooling, scoring and tokenizer paths (``router.apis.pooling``): forwarded to the
least-loaded replica serving the request's model, an alias rewritten to its served model
first. HTTP edge.
"""

from __future__ import annotations

import time

from aiohttp import web

from router.apis.aliases import AliasTable
from router.apis.pooling import request_model
from router.edges.http_errors import REQUEST_ID_KEY
from router.edges.proxy import Forward, Proxy
from router.observability.metrics import RouterMetrics
from router.request.dispatch import Dispatcher
from router.request.errors import RouterError
from router.request.routing import RequestRouter
from router.service.request_parse import RequestParser


class PassthroughHandler:
    """``handle_passthrough(request)``; ``proxy`` is set when the router starts. Each
    attempt's load ticket, first-byte deadline and connect failure go through
    ``dispatcher.passthrough()``; an answer's time teaches the deadline of the next."""

    def __init__(self, parser: RequestParser, aliases: AliasTable, router: RequestRouter,
                 dispatcher: Dispatcher, metrics: RouterMetrics) -> None:
        self.parser = parser
        self.aliases = aliases
        self.router = router
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.proxy: Proxy | None = None

    async def handle_passthrough(self, request: web.Request) -> web.StreamResponse:
        """Forward the request to the least-loaded replica serving its model; counted in
        ``router_requests_total``. Raises ``BadRequest`` for a body that is not JSON."""
        arrival = time.perf_counter()
        body = await self.parser.read(request)
        model = request_model(body.data())
        target = self.aliases.resolve(model) if model is not None else None
        if target is not None:
            body.set("model", target)
            model = target
        decision, targets = self.router.least_loaded(model)
        assert self.proxy is not None
        status = 500
        dispatch = self.dispatcher.passthrough()
        try:
            response, outcome = await self.proxy.forward(Forward(
                request, request.path, body.encoded(), targets, decision.reason,
                request[REQUEST_ID_KEY], arrival, dispatch))
            status = outcome.status
            if status == 200 and outcome.first_byte_s is not None:  # its first-byte deadline
                dispatch.observe_answer(outcome.replica_id, arrival + outcome.first_byte_s)
            return response
        except RouterError as exc:
            status = exc.status
            raise
        finally:
            self.metrics.requests.labels(decision.replica_id, decision.reason, request.path,
                                         str(status)).inc()
