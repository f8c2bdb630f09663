"""The router service: aiohttp app on uvloop, routes and start-up/shutdown. HTTP edge.

``main(argv)`` parses ``RouterConfig`` (CLI > ``ROUTER_*`` env > YAML), loads
the tokenizer once, starts the fleet reader (Redis) and/or the static replica
prober, listens, logs ``router listening on http://HOST:PORT`` and writes
``--ready-file``. ``RouterService`` wires the per-process state to the handlers (the generate
APIs: ``generate``; the pooling paths: ``passthrough``; the router's own endpoints: ``status``)
and the background loops (``background``, ``warm_up``), and starts and stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
from aiohttp import web

from router.apis.affinity import ResponseAffinity
from router.apis.aliases import AliasTable
from router.apis.pooling import FORWARDED_PATHS, STORED_RESPONSE_PATHS
from router.decision.fleet import Fleet
from router.decision.load import LoadTracker
from router.decision.ttft import PrefillRateLearner
from router.edges.auth import AuthConfigError, TenantAuth, auth_middleware, load_tenant_auth
from router.edges.circuit_probe import CircuitProber
from router.edges.client_connections import (
    advertise_keepalive,
    install_client_connections,
    server_idle_timeout_s,
)
from router.edges.fleet_sync import FleetReader, StaticProber, read_fleet_cache
from router.edges.http_errors import REQUEST_ID_KEY, body_limit_middleware, error_middleware
from router.edges.proxy import Proxy
from router.edges.upstream_connector import LagTolerantConnector
from router.edges.upstream_pool import UpstreamPool
from router.observability.audit import PrefixAudit
from router.observability.loop_lag import LoopLag
from router.observability.metrics import RouterMetrics
from router.observability.tracing import Tracing, TracingUnavailable, otlp_tracing
from router.request.chain_cache import ChainCache
from router.request.chat_render import TemplateRenderer
from router.request.dispatch import Dispatcher
from router.request.errors import REQUEST_ID_HEADER
from router.request.prompt_path import PromptChainer
from router.request.prompts import PromptTokenizer
from router.request.routing import RequestRouter
from router.service.audit_queue import AuditQueue
from router.service.background import BackgroundLoops
from router.service.config import SETTINGS, ConfigError, RouterConfig, load_config
from router.service.fleet_admission import FleetAdmission, traffic_classes
from router.service.generate import GenerateHandler
from router.service.heap import HeapTrimmer
from router.service.learning import RequestLearning
from router.service.passthrough import PassthroughHandler
from router.service.request_parse import API_PATHS, RequestParser
from router.service.response_holders import ResponseHolders
from router.service.status import StatusHandlers
from router.service.warm_up import WarmUp
from router.shared.hashing import BlockHasher, HashConfigError
from router.shared.logs import REQUEST_ID, configure_logging
from router.shared.messages_chat import merges_inline_system
from router.shared.process import loop_factory, write_json_atomic
from router.shared.redis_client import redis_client
from router.shared.settings import StartupError
from router.tools.rank_check import StaticRankCheck
from router.traffic.classes import TenantFileError

logger = logging.getLogger(__name__)

GC_GEN0_THRESHOLD = 20_000  # allocations between young-generation collections (CPython: 700)

# a client's X-Request-Id is kept only if short and plain (letters, digits, ._:/+=-), else replaced
_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
# a fresh id is 32 hex digits, as uuid4().hex was: 64 random bits per process and a counter
# (unique across routers without uuid4's 16 random bytes per request)
_REQUEST_ID_PREFIX = os.urandom(8).hex()
_REQUEST_NUMBERS = itertools.count()
CLIENT_LINGER_S = 1.0  # unread request body drained after the answer, at most (aiohttp: 10 s)
# an idle pooled upstream connection is closed after this: below uvicorn's 5 s keep-alive (vLLM's
# server closes idle connections then, and a reuse racing that close fails), and a burst of
# 1,000 streams leaves no 1,000 idle sockets open for long (issue 29: 1,048 fds 10 s after)
UPSTREAM_IDLE_S = 4.0


class RouterService:
    """Per-process router state wired to its handlers and background loops.

    The request path's steps (``parser`` -> ``admission`` -> ``router`` -> ``dispatcher`` ->
    ``proxy`` -> ``learning``) are separate objects; ``generate`` calls them in that order.
    ``proxy``, ``session``, ``reader`` and ``prober`` exist once the app has started."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer | None,
                 tracing: Tracing | None = None) -> None:
        self.config = config
        self.tracing = tracing or Tracing(None)
        self.hasher = BlockHasher(config.block_size, config.hash_algo, config.hash_seed)
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        self.heap = HeapTrimmer()
        self.fleet = Fleet(config, self.hasher)
        self.tracker = LoadTracker()
        self.aliases = AliasTable.from_specs(config.model_aliases)  # client-facing model names
        # the ttft policy's prefill rate per replica, fitted from streamed first-token times
        self.learner = PrefillRateLearner(config.ttft_prior_tokens_per_s)
        self.auth: TenantAuth | None = None
        if config.api_keys:
            self.auth = load_tenant_auth(
                config.api_keys, config.cache_salt_secret_file, config.client_cache_salt,
                config.admin_tenants, config.debug_access, config.metrics_access)
        self._wire_request_path(config, tokenizer)
        self.loop_lag = LoopLag()  # how late the loop ran: timeouts it made are not the replicas'
        self.background = BackgroundLoops(config, self.fleet, self.metrics, self.loop_lag,
                                          self.heap, self._prompt_caches)
        self.warm_up = WarmUp(tokenizer, self.chainer.executor, self.renderer,
                              self.render_executor)
        self._wire_handlers(config)
        self.reader: FleetReader | None = None
        self.prober: StaticProber | None = None
        self.session: aiohttp.ClientSession | None = None
        self.proxy: Proxy | None = None
        self.pool: UpstreamPool | None = None  # the proxy's httptools client, when chosen
        self._tasks: list[asyncio.Task[None]] = []

    def _wire_request_path(self, config: RouterConfig, tokenizer: PromptTokenizer | None) -> None:
        """The request path's steps: parse, admission, prompt chain and routing, dispatch, and
        learning from the answer (the proxy is made at start-up)."""
        # request-supplied chat templates (trusted only): rendered in a child process that is
        # killed on overrun; one thread waits on it so that no tokenizer thread ever does
        self.renderer: TemplateRenderer | None = None
        if config.trust_request_chat_template and tokenizer is not None:
            self.renderer = TemplateRenderer(tokenizer.source, config.chat_template_timeout_s,
                                             config.chat_template_max_bytes)
        self.render_executor = ThreadPoolExecutor(1, thread_name_prefix="chat-template")
        # /v1/messages: inline system messages merged into the first when the template wants
        # the system message first (vLLM probes its template the same way)
        self.parser = RequestParser(config, self.auth, self.aliases, self.renderer,
                                    self.render_executor, merges_inline_system(
                                        tokenizer.chat_template if tokenizer else None))
        # admission (router/traffic): the bounded queue in front of the fleet; off by default
        self.admission = FleetAdmission(config, self.fleet, self.tracker, self.learner,
                                        self.metrics, authenticated=self.auth is not None)
        chains = ChainCache(self.hasher, config.token_cache_chunks, config.index_stride,
                            max_bytes=config.prompt_cache_mib * 3 << 18)  # 3/4 of the MiB
        self.chainer = PromptChainer(chains, tokenizer, self.fleet.holds_key,
                                     config.tokenizer_threads)
        self.router = RequestRouter(config, self.fleet, self.tracker, self.learner, self.chainer,
                                    self.metrics, self.tracing)
        self.metrics.watch_prompt_caches(self._prompt_caches)
        self.dispatcher = Dispatcher(self.fleet, self.tracker, self.chainer, config.block_size,
                                     config.index_stride, self.router.uses_index,
                                     self._update_inflight, self.learner)
        self.audit = self._prefix_audit(config, tokenizer)
        self.audit_queue = AuditQueue(self.audit, tokenizer, config.audit_head_tokens)
        self.learning = RequestLearning(config.block_size, self.metrics, self.dispatcher,
                                        self.tracker, self.learner, self.audit_queue,
                                        name_adapters=self._metrics_private())

    def _prefix_audit(self, config: RouterConfig,
                      tokenizer: PromptTokenizer | None) -> PrefixAudit | None:
        """The template audit (``router.observability.audit``), None when off."""
        if not config.audit_families:
            return None
        decode = tokenizer.backend.decode if tokenizer is not None else None
        audit = PrefixAudit(config.block_size, decode, config.audit_families,
                            config.audit_head_tokens,
                            id_key=self.auth.family_id_key if self.auth else b"")
        # families are tenants' prompts: with API keys on, their series only where a key is
        # needed to read them (metrics_access admin)
        self.metrics.watch_audit(audit, config.audit_top_k, per_family=self._metrics_private())
        return audit

    def _metrics_private(self) -> bool:
        """Whether ``/metrics`` may carry what tenants sent (family ids, adapter names): no API
        keys (no tenants), or reading it needs an admin key (``metrics_access`` admin)."""
        return self.auth is None or self.auth.restrict_metrics

    def _wire_handlers(self, config: RouterConfig) -> None:
        # /v1/responses previous_response_id: which replica holds which stored response
        self.affinity = ResponseAffinity(self._affinity_redis if config.redis_url else None,
                                         config.redis_prefix, config.response_affinity_ttl_s)
        self.holders = holders = ResponseHolders(self.fleet, self.affinity)
        self.generate = GenerateHandler(
            self.parser, self.admission, self.router, holders,
            self.dispatcher, self.learning, self.metrics, self.loop_lag,
            config.overload_shed_min_inflight)
        self.passthrough = PassthroughHandler(self.parser, self.aliases, self.router,
                                              self.dispatcher, self.metrics, holders,
                                              self.admission.rate_limits)
        self.status = StatusHandlers(
            config, self.fleet, self.tracker, self.router, self.learner, self.aliases,
            self.parser, self.admission, self.warm_up, self.metrics, self._update_inflight,
            self.tokenizer, self.auth, self.audit)

    # -- lifecycle ---------------------------------------------------------------

    def build_app(self) -> web.Application:
        middlewares = [_request_id_middleware, error_middleware,
                       body_limit_middleware(self.config.max_body_bytes,
                                             self.generate.refused_unread)]
        if self.auth is not None:
            middlewares.append(auth_middleware(self.auth))
        if self.tracing.enabled:  # outside the error middleware: it sees the status sent
            middlewares.insert(1, self._tracing_middleware)
        app = web.Application(middlewares=middlewares, client_max_size=self.config.max_body_bytes)
        generate = self.generate.handle_generate
        app.router.add_post("/v1/completions", functools.partial(generate, "completion"))
        app.router.add_post("/v1/chat/completions", functools.partial(generate, "chat"))
        for kind, path in API_PATHS.items():
            app.router.add_post(path, functools.partial(generate, kind))
        for path in FORWARDED_PATHS:  # pooling, scoring, tokenizer: least loaded
            app.router.add_post(path, self.passthrough.handle_passthrough)
        for path, method in STORED_RESPONSE_PATHS.items():  # to the response's holder
            app.router.add_route(method, path, self.passthrough.handle_stored_response)
        status = self.status
        app.router.add_get("/v1/models", status.handle_models)
        app.router.add_get("/health", status.handle_health)
        app.router.add_get("/ready", status.handle_ready)
        app.router.add_get("/metrics", status.handle_metrics)
        app.router.add_post("/debug/route", status.handle_debug_route)
        app.router.add_get("/debug/prefixes", status.handle_debug_prefixes)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    @web.middleware
    async def _tracing_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """The request's server span (only installed with tracing on)."""
        attributes = {"http.request.method": request.method, "url.path": request.path,
                      "prefix_router.request_id": request[REQUEST_ID_KEY]}
        with self.tracing.server_span(f"{request.method} {request.path}", request.headers,
                                      attributes) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            return response

    def _start(self, loop: Any) -> None:
        self._tasks.append(asyncio.create_task(loop))

    async def _on_startup(self, app: web.Application) -> None:
        def count_give_back() -> None:  # a connect timer gave back the loop's lateness
            self.metrics.child(self.metrics.loop_late, "connect_give_back").inc()

        # its connect timeout gives back the time this router's own loop ran late
        connector = LagTolerantConnector(
            self.loop_lag, self.config.connect_timeout_s, count_give_back,
            limit=0, keepalive_timeout=UPSTREAM_IDLE_S, enable_cleanup_closed=True)
        # no cookie jar: the session is every client's, and a cookie one answer set (a sticky
        # load balancer in front of a replica) would ride along on every later request there
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             cookie_jar=aiohttp.DummyCookieJar())
        if self.config.upstream_client == "httptools":
            self.pool = UpstreamPool(self.config.connect_timeout_s, UPSTREAM_IDLE_S,
                                     self.loop_lag, count_give_back)
            logger.info("upstream client: httptools pool for http:// replicas")
        self.proxy = Proxy(self.session, self.config, self.metrics, self.fleet.health,
                           self.tracing, self.loop_lag, self.pool)
        self.generate.proxy = self.passthrough.proxy = self.proxy
        self.background.waits = self.proxy.waits
        self._start(self.loop_lag.run())
        self._start(CircuitProber(self.fleet, self.session, self.config, self.metrics,
                                  self.loop_lag).run())
        await self._start_fleet_sources(self.session)
        if self.renderer is not None:
            asyncio.get_running_loop().run_in_executor(self.render_executor, self.renderer.start)
        self._start(self.warm_up.run())
        self._start(self.background.housekeeping())
        self._start(self.background.sweeper())
        self._start(self.background.stall_watch())

    async def _start_fleet_sources(self, session: aiohttp.ClientSession) -> None:
        """Where the fleet comes from: static replicas (and fallbacks) probed, their DP ranks
        checked, and the Redis reader; returns once the first probe and the reader's first
        connection attempt are over."""
        config = self.config
        if config.redis_url:
            # until Redis answers: the last fleet seen there and the configured fallbacks
            added = self.fleet.add_fallbacks(read_fleet_cache(config.fleet_cache_file),
                                             config.fallback_replicas)
            if added:
                logger.info("%d fallback replicas until Redis gives the fleet", added)
        if config.replicas or any(r.fallback for r in self.fleet.replicas.values()):
            self.prober = StaticProber(self.fleet, config.static_probe_interval_s,
                                       config.health_failures)
            await self.prober.probe_once()
            self._start(self.prober.run())
        rank_check = StaticRankCheck(self.fleet, session, config.static_probe_interval_s)
        if rank_check.targets():  # static URL#RANK targets: does the engine have that rank?
            await rank_check.check_once()
            self._start(rank_check.run())
        if config.redis_url:
            self.reader = self.status.reader = FleetReader(self.fleet, config, self.metrics)
            self._start(self.reader.run())
            # listen once the first connection attempt is over: synced, or failed (then the
            # fallback replicas route while the reader retries)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.reader.attempted.wait(), timeout=5.0)

    async def _on_cleanup(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()
        if self.pool is not None:
            self.pool.close()
        self.chainer.shutdown()
        self.audit_queue.shutdown()
        self.render_executor.shutdown(wait=False, cancel_futures=True)
        if self.renderer is not None:
            self.renderer.close()
        await self.holders.drain()  # the last answers' holder records reach Redis first
        await self.affinity.close()

    def _affinity_redis(self) -> Any:
        return redis_client(self.config.redis_url or "", self.config.redis_password,
                            socket_connect_timeout=2.0, socket_timeout=2.0)

    def _prompt_caches(self) -> list[tuple[str, Any]]:
        caches: list[tuple[str, Any]] = [("chain", self.chainer.chains)]
        if self.tokenizer is not None:
            caches += [("chunk_tokens", self.tokenizer.cache),
                       ("rendered_chat", self.tokenizer.rendered)]
        return caches

    def _update_inflight(self, replica_id: str) -> None:
        self.admission.gate.kick()  # a load changed: room for a waiting request, maybe
        metrics = self.metrics
        metrics.child(metrics.inflight, replica_id).set(self.tracker.requests(replica_id))
        metrics.child(metrics.inflight_prefill, replica_id).set(
            self.tracker.prefill_tokens(replica_id))


@web.middleware
async def _request_id_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    request_id = request.headers.get(REQUEST_ID_HEADER, "")
    if not _REQUEST_ID_OK.fullmatch(request_id):  # reflected and logged: bounded and plain
        request_id = f"{_REQUEST_ID_PREFIX}{next(_REQUEST_NUMBERS):016x}"
    request[REQUEST_ID_KEY] = request_id
    REQUEST_ID.set(request_id)  # for every log line while serving it (the handler's own task)
    response = await handler(request)
    if REQUEST_ID_HEADER not in response.headers and not response.prepared:
        response.headers[REQUEST_ID_HEADER] = request_id
    return response



async def serve(config: RouterConfig, tokenizer: PromptTokenizer | None,
                tracing: Tracing | None = None) -> None:
    """Run the router until SIGINT/SIGTERM."""
    service = RouterService(config, tokenizer, tracing)
    app = service.build_app()
    # keepalive_timeout closes a client connection idle that long (the advertised timeout and a
    # grace: router.edges.client_connections), counted from its start or its last response, so also one
    # that dribbles its request head (slowloris; aiohttp 3.14), counted from the head's first
    # byte; after an answer to an unread body (408, 413) aiohttp reads on for lingering_time
    advertise_keepalive(app, config.client_idle_timeout_s)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=server_idle_timeout_s(config.client_idle_timeout_s),
                           lingering_time=CLIENT_LINGER_S)
    await runner.setup()
    assert runner.server is not None
    install_client_connections(runner.server)
    service.background.web_server = runner.server
    # after the stop signal: in-flight requests get shutdown_timeout_s to finish
    site = web.TCPSite(runner, config.host, config.port, backlog=1024,
                       shutdown_timeout=config.shutdown_timeout_s)
    try:
        await site.start()
    except OSError as exc:  # port in use, unknown host, no permission
        await runner.cleanup()
        raise StartupError(f"cannot listen on {config.host}:{config.port}: {exc}") from exc
    server = getattr(site, "_server", None)
    sockets = getattr(server, "sockets", None) or []
    port = sockets[0].getsockname()[1] if sockets else config.port
    url = f"http://{config.host}:{port}"
    logger.info("router listening on %s", url)
    if config.ready_file:
        write_json_atomic(config.ready_file, {"url": url})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        # graceful: /ready says 503 first (load balancers polling it stop sending), requests keep
        # being served for drain_delay_s, then the listener closes and in-flight ones finish
        service.status.draining = True
        logger.info("stopping: /ready is 503; closing the listener in %g s",
                    config.drain_delay_s)
        if config.drain_delay_s > 0:
            await asyncio.sleep(config.drain_delay_s)
    finally:
        await runner.cleanup()


def main(argv: Sequence[str]) -> int:
    """``prefix-router serve``: returns the process exit code."""
    try:
        config = load_config(argv)
        BlockHasher(config.block_size, config.hash_algo, config.hash_seed)
        if config.api_keys:
            load_tenant_auth(config.api_keys, config.cache_salt_secret_file)
        traffic_classes(config)
    except (ConfigError, HashConfigError, AuthConfigError, TenantFileError) as exc:
        print(f"prefix-router serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    configure_logging(config.log_level, config.log_format)
    for line in SETTINGS.misspelled_env(os.environ):
        logger.warning("%s", line)
    try:
        tracing = otlp_tracing(config.otlp_traces_endpoint)
    except TracingUnavailable as exc:
        print(f"prefix-router serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    tokenizer = None
    if config.tokenizer:
        try:
            # the chain cache serves repeated prefixes; the chunk-token cache only helps a chunk
            # seen after a different prefix, so it is kept smaller
            tokenizer = PromptTokenizer(config.tokenizer, config.token_cache_chunks // 8,
                                        cache_bytes=config.prompt_cache_mib << 17,  # 1/8 each
                                        render_cache_bytes=config.prompt_cache_mib << 17)
        except (OSError, ValueError) as exc:
            print(f"prefix-router serve: error: cannot load tokenizer {config.tokenizer!r}: {exc}",
                  file=sys.stderr, flush=True)
            return 2
    else:
        logger.warning("no --tokenizer: text prompts are routed by hashing the text "
                       "(router_untokenized_requests_total)")
    factory = loop_factory()
    if factory is None:
        logger.info("uvloop not available; using asyncio's default loop")
    # Start-up objects (transformers, the tokenizer) never die: keep them out of the cyclic
    # collector's scans, and collect the young generation less often, since a request
    # allocates thousands of short-lived containers (chain pieces, headers, JSON).
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)
    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            runner.run(serve(config, tokenizer, tracing))
        except StartupError as exc:
            print(f"prefix-router serve: error: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            tracing.shutdown()  # flush the last spans
    return 0
