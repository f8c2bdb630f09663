"""The router service: aiohttp app on uvloop, routes and start-up/shutdown. HTTP edge.

``main(argv)`` parses ``RouterConfig`` (CLI > ``ROUTER_*`` env > YAML), loads
the tokenizer once, starts the fleet reader (Redis) and/or the static replica
prober, listens, logs ``router listening on http://HOST:PORT`` and writes
``--ready-file``. ``RouterService`` holds the per-process state and the handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import logging
import re
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from router.apis.affinity import (
    ResponseAffinity,
    holder_target,
    response_id_from_head,
)
from router.apis.aliases import AliasTable, rewrite_model
from router.apis.messages import parse_messages
from router.apis.pooling import FORWARDED_PATHS, request_model
from router.apis.responses import ParsedResponses, parse_responses
from router.decision.fleet import Fleet
from router.decision.health import HUNG, MISSED, ROUTER_LATE
from router.decision.load import LoadTracker
from router.decision.policy import Decision, TtftPrediction
from router.decision.ttft import PrefillRateLearner, prefill_work_tokens
from router.edges.auth import (
    ADMIN_KEY,
    TENANT_KEY,
    AuthConfigError,
    TenantAuth,
    auth_middleware,
    load_tenant_auth,
)
from router.edges.circuit_probe import CircuitProber
from router.edges.client_connections import (
    advertise_keepalive,
    install_client_connections,
    is_idle,
    server_idle_timeout_s,
)
from router.edges.fleet_sync import FleetReader, StaticProber, read_fleet_cache
from router.edges.http_errors import (
    REQUEST_ID_KEY,
    body_limit_middleware,
    error_middleware,
)
from router.edges.proxy import REASON_HEADER, REPLICA_HEADER, Proxy, ProxyOutcome
from router.observability.audit import PrefixAudit, prompt_head
from router.observability.loop_lag import LoopLag
from router.observability.metrics import CONTENT_TYPE, RouterMetrics
from router.observability.tracing import Tracing, TracingUnavailable, otlp_tracing
from router.request.chain_cache import ChainCache
from router.request.chat_render import (
    CHILD_START_TIMEOUT_S,
    RENDER_PROCESSES,
    UNTRUSTED_TEMPLATE_MESSAGE,
    TemplateRenderer,
    has_request_template,
)
from router.request.dispatch import Dispatch, Dispatcher, GaugedTicket
from router.request.errors import (
    REQUEST_ID_HEADER,
    STATUS_CLIENT_CLOSED,
    BadRequest,
    NoRoutableReplica,
    RequestTimeout,
    RouterError,
)
from router.request.prompt_path import PromptChainer
from router.request.prompts import (
    PromptError,
    PromptSpec,
    PromptTokenizer,
    decode_json_body,
    parse_prompt,
    parse_request,
)
from router.request.routing import RequestRouter, Routed
from router.request.usage import (
    cached_tokens_from_sse_tail,
    cached_tokens_from_tail,
    completion_tokens_from_tail,
)
from router.service.config import ConfigError, RouterConfig, load_config
from router.service.heap import HeapTrimmer
from router.shared.contract import TIER_CPU
from router.shared.hashing import BlockHasher, HashConfigError
from router.shared.logs import REQUEST_ID, configure_logging
from router.shared.messages_chat import merges_inline_system
from router.shared.process import loop_factory, write_json_atomic
from router.shared.redis_client import redis_client
from router.shared.settings import StartupError
from router.tools.rank_check import StaticRankCheck
from router.traffic.admission import ReplicaLoad
from router.traffic.classes import (
    PRIORITY_HEADER,
    PriorityClasses,
    TenantFileError,
    load_tenant_file,
)
from router.traffic.gate import AdmissionEvent, AdmissionGate, AdmissionSlot
from router.traffic.metrics import AdmissionMetrics
from router.traffic.rate_limits import TenantRateLimits
from router.traffic.scheduling import FairOrder
from router.traffic.sessions import SESSION_HEADER

logger = logging.getLogger(__name__)

GC_GEN0_THRESHOLD = 20_000  # allocations between young-generation collections (CPython: 700)

SWEEP_KEYS_PER_STEP = 5_000  # index keys swept per event-loop turn (a short turn; benchmarks.md)
AUDIT_QUEUE = 64  # template-audit observations waiting at most (more are dropped and counted)
# a client's X-Request-Id is kept only if short and plain (letters, digits, ._:/+=-), else replaced
_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
CLIENT_LINGER_S = 1.0  # unread request body drained after the answer, at most (aiohttp: 10 s)
# an idle pooled upstream connection is closed after this: below uvicorn's 5 s keep-alive (vLLM's
# server closes idle connections then, and a reuse racing that close fails), and a burst of
# 1,000 streams leaves no 1,000 idle sockets open for long (issue 29: 1,048 fds 10 s after)
UPSTREAM_IDLE_S = 4.0


class RouterService:
    """Per-process router state and HTTP handlers."""

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
        # the request path's steps: prompt chain -> routing -> dispatch (-> proxy, at start-up)
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
        # admission (router/traffic): the bounded queue in front of the fleet; off by default
        self.classes = traffic_classes(config)
        self.admission = AdmissionGate(
            config.admission_limits(), self._admission_loads, self._admission_event,
            order=FairOrder(config.admission_priority_aging_s, weight_of=self.classes.weight_of))
        self.admission_metrics = AdmissionMetrics(
            self.metrics.registry, self.admission, self.classes.names,
            per_tenant=bool(config.api_keys) and config.metrics_access == "admin")
        self.rate_limits = TenantRateLimits(
            config.rate_limit_requests_per_min, config.rate_limit_tokens_per_min,
            load_tenant_file(config.admission_tenants_file) if config.admission_tenants_file
            else {}, lambda: redis_client(config.redis_url or "", config.redis_password,
                                          socket_connect_timeout=0.5, socket_timeout=0.5),
            config.redis_prefix, self.metrics.registry, config.redis_url)
        # request-supplied chat templates (trusted only): rendered in a child process that is
        # killed on overrun; one thread waits on it so that no tokenizer thread ever does
        self.renderer: TemplateRenderer | None = None
        if config.trust_request_chat_template and tokenizer is not None:
            self.renderer = TemplateRenderer(tokenizer.source, config.chat_template_timeout_s,
                                             config.chat_template_max_bytes)
        self.render_executor = ThreadPoolExecutor(1, thread_name_prefix="chat-template")
        # /v1/messages: inline system messages merged into the first when the template wants
        # the system message first (vLLM probes its template the same way)
        self.merge_inline_system = merges_inline_system(
            tokenizer.chat_template if tokenizer is not None else None)
        # /v1/responses previous_response_id: which replica holds which stored response
        self.affinity = ResponseAffinity(self._affinity_redis if config.redis_url else None,
                                         config.redis_prefix, config.response_affinity_ttl_s)
        self.reader: FleetReader | None = None
        self.prober: StaticProber | None = None
        self.session: aiohttp.ClientSession | None = None
        self.proxy: Proxy | None = None
        self.loop_lag = LoopLag()  # how late the loop ran: timeouts it made are not the replicas'
        self._tasks: list[asyncio.Task[None]] = []
        self.auth: TenantAuth | None = None
        if config.api_keys:
            self.auth = load_tenant_auth(
                config.api_keys, config.cache_salt_secret_file, config.client_cache_salt,
                config.admin_tenants, config.debug_access, config.metrics_access)
        self.audit: PrefixAudit | None = None
        if config.audit_families:
            decode = tokenizer.backend.decode if tokenizer is not None else None
            self.audit = PrefixAudit(config.block_size, decode, config.audit_families,
                                     config.audit_head_tokens,
                                     id_key=self.auth.family_id_key if self.auth else b"")
            # families are tenants' prompts: with API keys on, their series only where a key is
            # needed to read them (metrics_access admin)
            self.metrics.watch_audit(self.audit, config.audit_top_k, per_family=(
                self.auth is None or self.auth.restrict_metrics))
        # the audit's own thread: it never competes with routing for the tokenizer pool
        self.audit_executor = ThreadPoolExecutor(1, thread_name_prefix="audit")
        self._audit_queued = 0  # observations submitted and not yet done
        self.web_server: web.Server | None = None  # the listening server (client connections)
        self.draining = False  # stopping: /ready answers 503 while in-flight requests finish
        # the start-up step warming up (``_warm_up``): /ready answers 503 until it is ""
        self.warming = "start-up" if tokenizer is not None else ""

    # -- lifecycle ---------------------------------------------------------------

    def build_app(self) -> web.Application:
        middlewares = [_request_id_middleware, error_middleware,
                       body_limit_middleware(self.config.max_body_bytes, self._refused_unread)]
        if self.auth is not None:
            middlewares.append(auth_middleware(self.auth))
        if self.tracing.enabled:  # outside the error middleware: it sees the status sent
            middlewares.insert(1, self._tracing_middleware)
        app = web.Application(middlewares=middlewares, client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", functools.partial(self.handle_generate, "completion"))
        app.router.add_post("/v1/chat/completions", functools.partial(self.handle_generate, "chat"))
        for kind, path in API_PATHS.items():
            app.router.add_post(path, functools.partial(self.handle_generate, kind))
        app.router.add_get("/v1/models", self.handle_models)
        for path in FORWARDED_PATHS:  # pooling, scoring, tokenizer: least loaded
            app.router.add_post(path, self.handle_passthrough)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ready", self.handle_ready)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_post("/debug/route", self.handle_debug_route)
        app.router.add_get("/debug/prefixes", self.handle_debug_prefixes)
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

    async def _on_startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_IDLE_S,
                                         enable_cleanup_closed=True)
        # no cookie jar: the session is every client's, and a cookie one answer set (a sticky
        # load balancer in front of a replica) would ride along on every later request there
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             cookie_jar=aiohttp.DummyCookieJar())
        self.proxy = Proxy(self.session, self.config, self.metrics, self.fleet.health,
                           self.tracing, self.loop_lag)
        self._tasks.append(asyncio.create_task(self.loop_lag.run()))
        self._tasks.append(asyncio.create_task(CircuitProber(
            self.fleet, self.session, self.config, self.metrics, self.loop_lag).run()))
        if self.config.redis_url:
            # until Redis answers: the last fleet seen there and the configured fallbacks
            added = self.fleet.add_fallbacks(read_fleet_cache(self.config.fleet_cache_file),
                                             self.config.fallback_replicas)
            if added:
                logger.info("%d fallback replicas until Redis gives the fleet", added)
        if self.config.replicas or any(r.fallback for r in self.fleet.replicas.values()):
            self.prober = StaticProber(self.fleet, self.config.static_probe_interval_s,
                                       self.config.health_failures)
            await self.prober.probe_once()
            self._tasks.append(asyncio.create_task(self.prober.run()))
        rank_check = StaticRankCheck(self.fleet, self.session, self.config.static_probe_interval_s)
        if rank_check.targets():  # static URL#RANK targets: does the engine have that rank?
            await rank_check.check_once()
            self._tasks.append(asyncio.create_task(rank_check.run()))
        if self.config.redis_url:
            self.reader = FleetReader(self.fleet, self.config, self.metrics)
            self._tasks.append(asyncio.create_task(self.reader.run()))
            # listen once the first connection attempt is over: synced, or failed (then the
            # fallback replicas route while the reader retries)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.reader.attempted.wait(), timeout=5.0)
        if self.renderer is not None:
            asyncio.get_running_loop().run_in_executor(self.render_executor, self.renderer.start)
        self._tasks.append(asyncio.create_task(self._warm_up()))
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        self._tasks.append(asyncio.create_task(self._sweeper()))
        self._tasks.append(asyncio.create_task(self._stall_watch()))

    async def _warm_up(self) -> None:
        """Warm the tokenizer (the model's chat template compiled, a first encode) and then the
        render children (``TemplateRenderer.wait_warm``) while ``warming`` names the step, which
        keeps /ready false: no request pays for start-up (the first chats after start waited
        3.1-3.4 s on a quiet machine, 16.6-16.9 s on a busy one). Each step is bounded; one
        that fails or overruns is logged and the router gets ready without it."""
        loop = asyncio.get_running_loop()
        try:
            if self.tokenizer is not None:
                self.warming = "the tokenizer (chat template, first encode)"
                try:
                    await loop.run_in_executor(self.chainer.executor, self.tokenizer.warm)
                except PromptError as exc:
                    logger.warning("tokenizer warm-up: %s", exc)
            if self.renderer is not None:
                self.warming = "the chat render processes"
                if not await loop.run_in_executor(self.render_executor, self.renderer.wait_warm,
                                                  CHILD_START_TIMEOUT_S):
                    logger.warning("chat render processes not warm after %g s (%d of %d): "
                                   "ready without them", CHILD_START_TIMEOUT_S,
                                   self.renderer.num_warmed, RENDER_PROCESSES)
        finally:
            self.warming = ""
        logger.info("warm: tokenizer and chat render processes ready")

    def _warm_up_state(self) -> dict[str, Any]:
        """/ready's ``warm_up``: the step under way (``warming``, null once warm), the model
        template's compiles so far and the render children's warm-ups and cold renders."""
        renderer = self.renderer
        return {
            "warming": self.warming or None,
            "template_loads": self.tokenizer.num_template_loads if self.tokenizer else None,
            "render_processes": RENDER_PROCESSES if renderer else 0,
            "render_processes_warmed": renderer.num_warmed if renderer else None,
            "cold_renders": renderer.num_cold_renders if renderer else None,
        }

    async def _on_cleanup(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()
        self.chainer.shutdown()
        self.audit_executor.shutdown(wait=False, cancel_futures=True)
        self.render_executor.shutdown(wait=False, cancel_futures=True)
        if self.renderer is not None:
            self.renderer.close()
        await self.affinity.close()

    def _affinity_redis(self) -> Any:
        from router.shared.redis_client import redis_client

        return redis_client(self.config.redis_url or "", self.config.redis_password,
                            socket_connect_timeout=2.0, socket_timeout=2.0)

    def _close_idle_connections(self) -> int:
        """Close the oldest idle client connections beyond ``max_idle_client_connections``.
        Returns how many were closed (aiohttp keeps no such bound); one on which a request head
        is arriving is not idle."""
        if self.web_server is None:
            return 0
        idle = [h for h in self.web_server.connections if is_idle(h)]
        surplus = len(idle) - self.config.max_idle_client_connections
        for handler in idle[:max(surplus, 0)]:  # oldest first
            handler.force_close()
        return max(surplus, 0)

    def _prompt_caches(self) -> list[tuple[str, Any]]:
        caches: list[tuple[str, Any]] = [("chain", self.chainer.chains)]
        if self.tokenizer is not None:
            caches += [("chunk_tokens", self.tokenizer.cache),
                       ("rendered_chat", self.tokenizer.rendered)]
        return caches

    def _prompt_cache_gauges(self) -> None:
        for name, cache in self._prompt_caches():
            self.metrics.prompt_cache_bytes.labels(name).set(cache.num_bytes)
            self.metrics.prompt_cache_entries.labels(name).set(len(cache))

    async def _housekeeping(self) -> None:
        """Prune expired speculative placements, bound idle client connections and refresh
        gauges once a second."""
        while True:
            self._close_idle_connections()
            now = time.monotonic()
            self.fleet.speculative.prune(now)
            self.metrics.speculative_blocks.set(len(self.fleet.speculative))
            self.metrics.index_blocks.set(len(self.fleet.index))
            self._prompt_cache_gauges()
            self.metrics.fleet_panic.set(1 if self.fleet.panic(now)[0] else 0)
            if self.heap.due():  # a large prompt's freed memory back to the OS (router.service.heap)
                await asyncio.to_thread(self.heap.trim)
            for rid, replica in self.fleet.replicas.items():
                routable = self.fleet.routable_problem(replica, now) is None
                self.metrics.replica_routable.labels(rid).set(1 if routable else 0)
                self.metrics.set_replica_target(rid, replica.url, replica.dp_rank)
                affinity = self.fleet.affinity_problem(replica) is None
                self.metrics.replica_affinity.labels(rid).set(1 if affinity else 0)
                mismatch = self.fleet.config_mismatch(replica) is not None
                self.metrics.replica_config_mismatch.labels(rid).set(1 if mismatch else 0)
            await asyncio.sleep(1.0)

    async def _stall_watch(self) -> None:
        """Bench replicas that stopped sending bytes while others did, or hung past a first-byte
        deadline, count missed deadlines (``router.decision.health``), and move requests that still wait
        for a first byte to the next replica. A replica's KV events count as its progress."""
        health = self.fleet.health
        cfg = self.config
        interval = min(1.0, cfg.stall_timeout_s / 4, cfg.first_byte_deadline_floor_s / 4)
        entries: dict[str, tuple[int, int]] = {}  # {replica_id: (epoch, entry_seq) last seen}
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for rid, replica in self.fleet.replicas.items():
                seen = entries.get(rid)
                entries[rid] = (replica.epoch, replica.entry_seq)
                # new stream entries: the engine stored or evicted blocks
                events = (seen is not None and seen[0] == replica.epoch
                          and seen[1] < replica.entry_seq)
                health.engine_report(rid, now, replica.num_running + replica.num_waiting > 0,
                                     events)
            for gone in entries.keys() - self.fleet.replicas.keys():
                del entries[gone]
            self._judge_overdue(now)
            for rid in health.stalled(now):
                if self.loop_lag.late(now - cfg.stall_timeout_s, now):
                    # its bytes may sit unread: the router was late, not the replica
                    self.metrics.child(self.metrics.loop_late, "stalled").inc()
                    continue
                health.trip(rid, now, "stalled")
                self.metrics.child(self.metrics.upstream_errors, rid, "stalled").inc()
                moved = self.proxy.abort_waiting(rid) if self.proxy is not None else 0
                logger.warning("replica %s sent nothing for %.0f s while others did: benched; "
                               "%d waiting requests moved", rid, self.config.stall_timeout_s, moved)

    def _judge_overdue(self, now: float) -> None:
        """Act on the attempts past their first-byte deadline (``ReplicaHealth.overdue``)."""
        health = self.fleet.health
        for overdue in health.overdue(now, self.loop_lag.late):
            rid = overdue.replica_id
            if overdue.verdict == ROUTER_LATE:
                self.metrics.child(self.metrics.loop_late, MISSED).inc()
                continue
            self.metrics.child(self.metrics.upstream_errors, rid, overdue.verdict).inc()
            if overdue.verdict == HUNG:
                health.trip(rid, now, HUNG)
                moved = self.proxy.abort_waiting(rid, HUNG) if self.proxy is not None else 0
                logger.warning("replica %s sent nothing past a first-byte deadline while others "
                               "progressed: benched; %d waiting requests moved", rid, moved)
                continue
            if health.record_failure(rid, now, MISSED):
                logger.warning("replica %s: circuit opened after %s", rid, MISSED)
            if overdue.fallback and self.proxy is not None:
                self.proxy.abort_attempt(overdue.token, MISSED)

    async def _sweeper(self) -> None:
        """Sweep retired index slots (replica cleared or dropped) in steps that yield to the loop."""
        while True:
            if self.fleet.index.sweep_pending:
                self.fleet.sweep_index(SWEEP_KEYS_PER_STEP)
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(0.05)

    # -- routing -----------------------------------------------------------------

    async def _request_template(self, spec: PromptSpec) -> PromptSpec:
        """A chat request's own ``chat_template``: refused as vLLM does unless
        ``trust_request_chat_template``; when trusted, rendered in the bounded child process
        (``router.request.chat_render``) and the spec carries the text. Raises ``BadRequest``."""
        if not has_request_template(spec):
            return spec
        if not self.config.trust_request_chat_template:
            raise BadRequest(UNTRUSTED_TEMPLATE_MESSAGE)
        if self.renderer is None:
            return spec  # no tokenizer: routed by hashing the text, never rendered here
        loop = asyncio.get_running_loop()
        # a PromptError is a BadRequest: the error middleware answers it
        text = await loop.run_in_executor(self.render_executor, self.renderer.render, spec)
        return dataclasses.replace(spec, text=text)

    # -- handlers ----------------------------------------------------------------

    async def _read_json(self, request: web.Request) -> tuple[bytes, Any]:
        body = await _read_body(request, self.config.client_body_timeout_s)
        return body, decode_json_body(body)

    async def handle_generate(self, kind: str, request: web.Request) -> web.StreamResponse:
        """Completions and chat: every outcome, the router's own errors included, is counted in
        ``router_requests_total``; errors after a decision carry the routing headers."""
        counted = _Counted(request.path)
        try:
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
            self.metrics.child(self.metrics.requests, counted.replica_id, counted.reason,
                               counted.endpoint, str(counted.status)).inc()

    def _refused_unread(self, request: web.Request, status: int) -> None:
        """A completions or chat request refused before its handler ran (a declared body over
        ``max_body_bytes``) is counted in ``router_requests_total`` as the handler counts it."""
        if request.path in GENERATE_PATHS:
            self.metrics.child(self.metrics.requests, "", "none", request.path, str(status)).inc()

    async def _generate(self, kind: str, request: web.Request,
                        counted: _Counted) -> web.StreamResponse:
        """The request path: parse -> prompt chain and routing -> dispatch record -> proxy."""
        arrival = time.perf_counter()
        spec, body = await self._parse(kind, request)  # 1. parse (and a request's own template)
        await self.rate_limits.check(request.get(TENANT_KEY) or "", _prompt_tokens(spec))  # 429
        slot = await self._admit(spec, body, request)  # admission: waits for room, or 503
        if self.config.admission_forward_priority and self.admission.enabled:
            body = _with_priority(body, slot.priority)
        try:  # 2-3. the prompt's chain, the decision (among the replicas with room)
            continued = request.get(RESPONSES_KEY)
            if continued is not None and continued.previous_response_id is not None:
                routed = await self._route_to_holder(continued.previous_response_id, spec)
            else:
                routed = await self.router.route(spec, has_room=self._replica_has_room
                                                 if self.admission.enabled else None,
                                                 session_id=request.headers.get(SESSION_HEADER))
        except BaseException:
            slot.release()
            raise
        decision = routed.decision
        counted.replica_id, counted.reason = decision.replica_id, decision.reason
        dispatch = self.dispatcher.begin(routed, spec)  # 4. owns tickets, placements, writes
        endpoint = request.path
        status, replica_id = 500, decision.replica_id

        def sent(rid: str) -> None:
            self.metrics.child(self.metrics.overhead, endpoint).observe(time.perf_counter() - arrival)
            dispatch.sent(rid)

        assert self.proxy is not None
        try:
            slot.dispatched()  # counted in the replica's load from the proxy's first step on
            response, outcome = await self.proxy.forward(  # 5. proxy
                request, endpoint, body, routed.targets, decision.reason,
                request[REQUEST_ID_KEY], dispatch.start_ticket,
                lambda rid: self.fleet.mark_failed(rid, time.monotonic()), arrival, sent,
                streamed=spec.stream, expected_s=dispatch.expected_first_byte_s)
            status, replica_id = outcome.status, outcome.replica_id
            counted.status, counted.replica_id = status, replica_id
            if continued is not None and continued.store and status == 200:
                await self._remember_response(outcome)
            if status == 200:
                self.router.served(routed, replica_id)
            self._observe(spec, routed, dispatch, outcome, arrival, request.get(TENANT_KEY))
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

    async def _admit(self, spec: PromptSpec, body: bytes,
                     request: web.Request) -> AdmissionSlot:
        """Wait for room in the fleet (``router.traffic.gate``) in the request's priority class
        and its tenant's share (``router.traffic.classes``); raises ``Overloaded`` (503 with
        Retry-After), ``BadRequest`` for an unknown class. The request's cost for fairness is
        its prefill without a hit at the fleet's typical rate, its length the token ids' or
        estimated from the text (4 characters a token: it is tokenized when routed, after the
        wait)."""
        if not self.admission.enabled:
            return await self.admission.admit(request[REQUEST_ID_KEY], spec.model)
        tenant, rank, work, target_s = self._admission_terms(spec, body, request)
        cost_s = work * self.learner.estimate("").s_per_token
        return await self.admission.admit(request[REQUEST_ID_KEY], spec.model, cost_s, rank,
                                          tenant, work, target_s)

    def _admission_terms(self, spec: PromptSpec, body: bytes, request: web.Request,
                         ) -> tuple[str, int, float, float | None]:
        """A request's tenant ("" without keys), class rank, own prefill work tokens without a
        hit, and TTFT target (seconds; None: none). Raises ``BadRequest`` for a bad class."""
        tenant = request.get(TENANT_KEY)
        try:
            body_priority = _PRIORITY.decode(body).priority
        except msgspec.ValidationError as exc:  # (parsed already: only a non-object body)
            raise BadRequest(f"request body: {exc}") from exc
        rank = self.classes.request_rank(request.headers.get(PRIORITY_HEADER), body_priority,
                                         tenant, self.auth is not None)
        return (tenant or "", rank, prefill_work_tokens(_prompt_tokens(spec), 0),
                self.classes.ttft_target_s(rank, tenant))

    def _replica_load(self, replica_id: str) -> ReplicaLoad:
        """A replica's load for admission: this router's requests in flight there, and the
        prefill tokens of those not yet at their first token at its learned rate (seconds)."""
        rate = self.learner.estimate(replica_id)
        return ReplicaLoad(replica_id, self.tracker.requests(replica_id),
                           self.tracker.prefill_tokens(replica_id) * rate.s_per_token,
                           rate.s_per_token, rate.overhead_s)

    def _replica_has_room(self, replica_id: str) -> bool:
        return self.admission.limits.replica_has_room(self._replica_load(replica_id))

    def _admission_loads(self, model: str | None) -> list[ReplicaLoad] | None:
        """The loads of the replicas that could serve ``model`` now; None when routing would
        refuse it (unknown model, no routable replica: answered at once, not queued)."""
        try:
            eligible, _, _ = self.fleet.eligible(model, time.monotonic())
        except RouterError:
            return None
        return [self._replica_load(r.replica_id) for r in eligible]

    def _admission_event(self, event: AdmissionEvent) -> None:
        self.admission_metrics.observe(event)

    async def _parse(self, kind: str, request: web.Request) -> tuple[PromptSpec, bytes]:
        """The request parsed to a ``PromptSpec`` (a request's own chat template rendered when
        trusted), and its body as sent on (under the tenant's cache_salt). Raises
        ``BadRequest``."""
        body = await _read_body(request, self.config.client_body_timeout_s)
        if self.auth is not None:
            body = self.auth.salted_body(request, body)  # the tenant's cache_salt
        if kind == "responses":
            parsed = parse_responses(decode_json_body(body))
            request[RESPONSES_KEY] = parsed
            spec = parsed.spec
        elif kind == "messages":
            spec = parse_messages(decode_json_body(body),
                                  merge_inline_system=self.merge_inline_system)
        else:
            spec = parse_request(kind, body)
        body, spec = self._aliased(body, spec)
        if kind in API_PATHS:  # rendered already, by that API's own conversion
            return spec, body
        return await self._request_template(spec), body

    def _aliased(self, body: bytes, spec: PromptSpec) -> tuple[bytes, PromptSpec]:
        """``body`` and ``spec`` with an alias ``model`` rewritten to the served model it maps
        to (``router.apis.aliases``: the split advances); unchanged for any other model."""
        target = self.aliases.resolve(spec.model) if spec.model is not None else None
        if target is None:
            return body, spec
        return (rewrite_model(decode_json_body(body), target),
                dataclasses.replace(spec, model=target))

    async def _route_to_holder(self, response_id: str, spec: PromptSpec) -> Routed:
        """A Responses request continuing ``response_id``: to the replica holding it
        (``router.apis.affinity``), its prompt unhashed (its prefix is the stored conversation,
        which only the engine has). Raises ``ResponseNotFound`` (404), ``NoRoutableReplica``."""
        holder = await self.affinity.holder(response_id)
        decision, targets, lora = holder_target(self.fleet, response_id, holder, spec.model,
                                                time.monotonic())
        return Routed(decision, max(1, len(spec.fallback_text()) // 4), [], targets,
                      tokenized=False, lora=lora)

    async def _remember_response(self, outcome: ProxyOutcome) -> None:
        """Record which replica answered a Responses request (its id from the answer's head)."""
        response_id = response_id_from_head(outcome.head)
        if response_id is not None:
            await self.affinity.remember(response_id, outcome.replica_id)

    def _observe(self, spec: PromptSpec, routed: Routed, dispatch: Dispatch,
                 outcome: ProxyOutcome, arrival: float, tenant: str | None) -> None:
        """What an answered request teaches: first-byte rates, TTFT metrics, hit counters and
        the template audit."""
        decision, replica_id, status = routed.decision, outcome.replica_id, outcome.status
        if outcome.first_byte_s is not None and status == 200:
            since_send_s = arrival + outcome.first_byte_s - dispatch.sent_at(replica_id)
            if not spec.stream:  # its first byte is the whole answer: not a TTFT
                dispatch.observe_answer(replica_id, since_send_s)
            else:
                self.dispatcher.observe_first_byte(replica_id, outcome.first_byte_s,
                                                   dispatch.prefill_tokens)
                self._observe_ttft(spec, decision, outcome)
                self._observe_first_token(dispatch.prediction(replica_id), replica_id,
                                          since_send_s)
        hit_tokens = decision.hit_blocks * self.config.block_size
        predicted_hit = hit_tokens if replica_id == decision.replica_id else 0
        self.metrics.child(self.metrics.prompt_tokens, replica_id).inc(routed.num_tokens)
        self.metrics.child(self.metrics.predicted_hit_tokens, replica_id).inc(predicted_hit)
        if replica_id == decision.replica_id and decision.predicted_hit:  # per tier
            hit = decision.hit(replica_id)
            self.metrics.child(self.metrics.predicted_tier_hit_blocks, replica_id,
                               "GPU").inc(hit.blocks)
            self.metrics.child(self.metrics.predicted_tier_hit_blocks, replica_id,
                               "CPU").inc(hit.cpu_blocks)
        if status == 200:
            generated = completion_tokens_from_tail(outcome.tail)
            if generated is not None:  # the decode term's typical output length (ttft policy)
                self.tracker.observe_output(generated)
            self._audit_request(spec, routed.num_tokens, predicted_hit, outcome, tenant)

    def _observe_ttft(self, spec: PromptSpec, decision: Decision, outcome: ProxyOutcome) -> None:
        """``router_ttft_seconds`` of a streamed answer, split by the engine's own cached_tokens
        when its last event reported usage, else by the router's prediction."""
        cached = cached_tokens_from_sse_tail(outcome.tail)
        if cached is not None:
            cache, source = ("hit" if cached > 0 else "miss"), "engine"
        else:
            cache, source = ("hit" if decision.predicted_hit else "miss"), "predicted"
        assert outcome.first_byte_s is not None
        self.metrics.child(self.metrics.ttft, spec.model or "", cache, source).observe(
            outcome.first_byte_s)

    def _observe_first_token(self, predicted: TtftPrediction | None, replica_id: str,
                             ttft_s: float) -> None:
        """A streamed request's first byte came ``ttft_s`` after its dispatch to ``replica_id``:
        teach the prefill-rate learner (every policy: the first-byte deadlines use its
        estimate), and record how far off the prediction made at the send was."""
        if predicted is None:
            return
        self.learner.observe(replica_id, predicted.work_tokens, ttft_s)
        self.metrics.child(self.metrics.ttft_prediction_error, replica_id).observe(
            ttft_s - predicted.ttft_s)

    def _audit_request(self, spec: PromptSpec, num_tokens: int, predicted_hit_tokens: int,
                       outcome: ProxyOutcome, tenant: str | None) -> None:
        """Hand a served request to the template audit on its own thread (dropped, and counted,
        when ``AUDIT_QUEUE`` observations are already waiting)."""
        audit = self.audit
        if audit is None:
            return
        if self._audit_queued >= AUDIT_QUEUE:
            audit.drop(tenant)
            return
        cached = cached_tokens_from_tail(outcome.tail)
        head = self.config.audit_head_tokens

        def observe() -> None:
            tokens = prompt_head(spec, self.tokenizer, head)
            if tokens is not None:
                audit.observe(tokens, num_tokens, predicted_hit_tokens, cached, tenant)

        def done(fut: asyncio.Future[None]) -> None:
            self._audit_queued -= 1
            if not fut.cancelled() and fut.exception() is not None:
                logger.warning("template audit failed on a request: %r", fut.exception())

        self._audit_queued += 1
        try:
            future = asyncio.get_running_loop().run_in_executor(self.audit_executor, observe)
        except RuntimeError:  # the executor is shut down: the router is stopping
            self._audit_queued -= 1
            return
        future.add_done_callback(done)

    def _update_inflight(self, replica_id: str) -> None:
        self.admission.kick()  # a load changed: room for a waiting request, maybe
        self.metrics.child(self.metrics.inflight, replica_id).set(self.tracker.requests(replica_id))
        self.metrics.child(self.metrics.inflight_prefill, replica_id).set(self.tracker.prefill_tokens(replica_id))

    async def handle_passthrough(self, request: web.Request) -> web.StreamResponse:
        """The pooling, scoring and tokenizer paths (``router.apis.pooling``): the least-loaded
        replica serving the model (an alias rewritten to its served model first)."""
        arrival = time.perf_counter()
        body, data = await self._read_json(request)
        model = request_model(data)
        target = self.aliases.resolve(model) if model is not None else None
        if target is not None:
            body, model = rewrite_model(data, target), target
        decision, targets = self.router.least_loaded(model)
        assert self.proxy is not None
        status = 500
        try:
            response, outcome = await self.proxy.forward(
                request, request.path, body, targets, decision.reason, request[REQUEST_ID_KEY],
                lambda rid: GaugedTicket(self.tracker.dispatch(rid, 0), self._update_inflight),
                lambda rid: self.fleet.mark_failed(rid, time.monotonic()), arrival)
            status = outcome.status
            return response
        except RouterError as exc:
            status = exc.status
            raise
        finally:
            self.metrics.requests.labels(decision.replica_id, decision.reason, request.path,
                                         str(status)).inc()

    async def handle_models(self, request: web.Request) -> web.Response:
        """Union of the models of the replicas routed to (the routable ones, or in panic mode
        all it routes to); 503 when there is none (an empty list would tell a client the router
        serves no model at all)."""
        now = time.monotonic()
        if not self.fleet.routed(now):
            raise NoRoutableReplica("no routable replica: the served models are unknown" if not
                                    self.fleet.replicas else "no routable replica")
        cards = self.fleet.model_cards(now)
        aliases = self.aliases.cards({str(c.get("id")): c for c in cards})
        return web.json_response({"object": "list", "data": cards + aliases})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_ready(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        replicas = []
        routed = {r.replica_id for r in self.fleet.routed(now)}
        for rid in sorted(self.fleet.replicas):
            r = self.fleet.replicas[rid]
            problem = self.fleet.routable_problem(r, now)
            affinity_problem = self.fleet.affinity_problem(r)
            replicas.append({
                "replica_id": rid, "url": r.url, "dp_rank": r.dp_rank, "static": r.static,
                "routable": problem is None,
                "not_routable_reason": problem, "affinity": affinity_problem is None,
                "no_affinity_reason": affinity_problem, "hash_verified": r.hash_verified,
                "config_mismatch": self.fleet.config_mismatch(r), "index_stride": r.index_stride,
                "epoch": r.epoch, "models": sorted(r.models) if r.models is not None else None,
                "lora_adapters": sorted(r.lora_adapters), "lora": None if r.lora is None else {
                    "running": sorted(r.lora.running), "waiting": sorted(r.lora.waiting),
                    "max_lora": r.lora.max_lora}, "num_running": r.num_running,
                "num_waiting": r.num_waiting, "kv_usage": r.kv_usage,
                "index_blocks": self.fleet.index.num_blocks(rid),
                "index_cpu_blocks": self.fleet.index.num_blocks(rid, TIER_CPU),
                "kv_tiers": list(r.kv_tiers),
                "circuit": self.fleet.health.state(rid),
                "routed": rid in routed,  # requests go there now (in panic mode: unroutable too)
                "refused_connections": self.fleet.health.refused(rid, now),
                "inflight_requests": self.tracker.requests(rid),
                "inflight_prefill_tokens": self.tracker.prefill_tokens(rid),
            })
        panic, num_routable, num_replicas = self.fleet.panic(now)
        # in panic mode the router routes to replicas /ready lists as not routable ("routed")
        not_ready = self.fleet.not_ready(now)
        ready = not_ready is None and not self.draining and not self.warming
        body = {"ready": ready, "not_ready_reason": not_ready,
                "draining": self.draining, "warm_up": self._warm_up_state(),
                "admission": self.admission.state(),
                "policy": self.config.policy,
                "panic": {"active": panic, "routable_replicas": num_routable,
                          "replicas": num_replicas, "threshold": self.config.panic_threshold},
                "redis": None if self.reader is None else {
                    "connected": self.reader.connected, "last_stream_id": self.reader.last_id,
                    # writes refused for lack of memory: routing goes on, the index lags
                    "oom": self.reader.oom,
                    "oom_replicas": sorted(rid for rid, r in self.fleet.replicas.items()
                                           if r.redis_oom)},
                "tokenizer": self.tokenizer.source if self.tokenizer else None,
                "index_blocks": len(self.fleet.index), "index_stride": self.config.index_stride,
                "config_mismatches": sorted(str(r["replica_id"]) for r in replicas
                                            if r["config_mismatch"]),
                "replicas": replicas}
        return web.json_response(body, status=200 if ready else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        for rid in self.fleet.replicas:
            self._update_inflight(rid)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def handle_debug_route(self, request: web.Request) -> web.Response:
        """The decision for a completions or chat body, without sending it (with API keys on,
        under the caller's tenant salt: a tenant sees only its own prefixes)."""
        body = await _read_body(request, self.config.client_body_timeout_s)
        if self.auth is not None:
            body = self.auth.salted_body(request, body)
        data = decode_json_body(body)
        kind = request.query.get("api", "")  # responses | messages: that API's body
        if kind == "responses":
            spec = parse_responses(data).spec
        elif kind == "messages":
            spec = parse_messages(data, merge_inline_system=self.merge_inline_system)
        else:
            kind = "chat" if isinstance(data, dict) and "messages" in data else "completion"
            spec = parse_prompt(kind, data)
        target = self.aliases.resolve(spec.model, advance=False) if spec.model else None
        if target is not None:  # where the next request naming the alias would go
            spec = dataclasses.replace(spec, model=target)
        if kind not in API_PATHS:
            spec = await self._request_template(spec)
        routed = await self.router.route(spec, dry_run=True,
                                         session_id=request.headers.get(SESSION_HEADER))
        d = routed.decision
        extra: dict[str, Any] = {}
        if request.query.get("token_ids") in ("1", "true") and self.tokenizer is not None:
            # the prompt's token ids as the router computes them (to hold against the engine's
            # own /tokenize); only on request: a long prompt's ids are a large answer
            extra["token_ids"] = await asyncio.get_running_loop().run_in_executor(
                self.chainer.executor, self.tokenizer.prompt_tokens, spec)
        return web.json_response({**extra,
            "kind": kind, "model": spec.model, "policy": self.config.policy,
            "tokenized": routed.tokenized,
            "lora_affinity": None if routed.lora_affinity is None else {
                "adapter": routed.lora_affinity.adapter, "tier": routed.lora_affinity.tier,
                "replicas": dict(routed.lora_affinity.tiers)},
            "num_tokens": routed.num_tokens, "chain_blocks": len(routed.chain),
            "block_size": self.config.block_size, "replica": d.replica_id, "reason": d.reason,
            "hit_blocks": d.hit_blocks, "hit_tokens": d.hit_blocks * self.config.block_size,
            "cpu_hit_blocks": d.hit(d.replica_id).cpu_blocks,
            "fallbacks": list(d.fallbacks), "replicas": d.details,
            # the session's replica (x-session-id / prompt_cache_key), kept or left
            "session_replica": routed.session_replica,
            # where each candidate's attempt would go: engine URL and DP rank (vLLM header)
            "targets": {t.replica_id: {"url": t.url, "dp_rank": t.dp_rank}
                        for t in routed.targets},
            "load": self.tracker.snapshot(),
            # whether the request would wait for room now, and why (router/traffic)
            "admission": {**self.admission.state(), **self.admission.explain(
                spec.model, *self._admission_terms(spec, body, request)[1:])},
            # the typical lengths standing in for load this router cannot count (ttft policy)
            "avg_prompt_tokens": round(self.tracker.avg_prompt_tokens, 1),
            "avg_output_tokens": round(self.tracker.avg_output_tokens, 1),
            "prefill_rates": {
                rid: {"tokens_per_s": round(est.tokens_per_s, 1),
                      "overhead_s": round(est.overhead_s, 6), "samples": est.num_samples}
                for rid in d.details for est in (self.learner.estimate(rid),)},
        })


    async def handle_debug_prefixes(self, request: web.Request) -> web.Response:
        """The template audit: top prefix families (``?top=K``), near misses, block-boundary
        waste, hit rate per family. With API keys on, a tenant that is not an admin sees only its
        own families."""
        if self.audit is None:
            return web.json_response({"enabled": False, "families": []})
        try:
            top = int(request.query.get("top", self.config.audit_top_k))
        except ValueError as exc:
            raise BadRequest("'top' must be an integer") from exc
        everyone = self.auth is None or bool(request.get(ADMIN_KEY))
        body = self.audit.report(top, tenant=request.get(TENANT_KEY), all_tenants=everyone)
        return web.json_response({"enabled": True, **body})


@web.middleware
async def _request_id_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    request_id = request.headers.get(REQUEST_ID_HEADER, "")
    if not _REQUEST_ID_OK.fullmatch(request_id):  # reflected and logged: bounded and plain
        request_id = uuid.uuid4().hex
    request[REQUEST_ID_KEY] = request_id
    REQUEST_ID.set(request_id)  # for every log line while serving it (the handler's own task)
    response = await handler(request)
    if REQUEST_ID_HEADER not in response.headers and not response.prepared:
        response.headers[REQUEST_ID_HEADER] = request_id
    return response


# the APIs besides completions and chat that are routed by prefix, by request kind (router.apis)
API_PATHS: Final = {"responses": "/v1/responses", "messages": "/v1/messages"}
GENERATE_PATHS: Final = frozenset({"/v1/completions", "/v1/chat/completions",
                                   *API_PATHS.values()})
# a Responses request's parse (router.apis.responses.ParsedResponses), for its routing
RESPONSES_KEY: Final = web.RequestKey("responses", ParsedResponses)


class _Priority(msgspec.Struct):
    """The body's ``priority`` (vLLM's field), checked by ``PriorityClasses.request_rank``."""

    priority: Any = None


_PRIORITY: Final = msgspec.json.Decoder(_Priority)  # the body parsed already: valid JSON


def _with_priority(body: bytes, rank: int) -> bytes:
    """``body`` (a JSON object) with vLLM's ``priority`` set to ``rank``: vLLM's priority
    scheduler serves lower values first (``--scheduling-policy priority``), as ranks go."""
    data = msgspec.json.decode(body)
    data["priority"] = rank
    return msgspec.json.encode(data)


def _prompt_tokens(spec: PromptSpec) -> int:
    """The prompt's length in tokens before tokenizing: its token ids', else its text's length
    / 4 (admission's fair-share cost, the rate limits' tokens)."""
    return (len(spec.token_ids) if spec.token_ids is not None
            else max(1, len(spec.fallback_text()) // 4))


def traffic_classes(config: RouterConfig) -> PriorityClasses:
    """The priority classes with the tenant file's settings. Raises ``TenantFileError``."""
    tenants = (load_tenant_file(config.admission_tenants_file)
               if config.admission_tenants_file else {})
    try:
        return config.priority_classes(tenants)
    except ValueError as exc:
        raise TenantFileError(f"{config.admission_tenants_file}: {exc}") from exc


@dataclass(slots=True)
class _Counted:
    """What ``router_requests_total`` records of one request (filled in as it goes)."""

    endpoint: str
    replica_id: str = ""  # "" when no replica was chosen (the router answered itself)
    reason: str = "none"
    status: int = 500


async def _read_body(request: web.Request, timeout_s: float) -> bytes:
    """The request body, decoded per its Content-Encoding (aiohttp does that); a body that does
    not decode is a 400 (413 beyond ``max_body_bytes`` is raised by aiohttp), one that takes
    longer than ``timeout_s`` to arrive a 408 (and the connection is closed)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except RequestPayloadError as exc:
        raise BadRequest(f"request body could not be read: {exc}") from exc
    except TimeoutError as exc:
        raise RequestTimeout(f"request body not received within {timeout_s:g} s "
                             "(client_body_timeout_s)") from exc



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
    service.web_server = runner.server
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
        service.draining = True
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
