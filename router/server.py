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
import json
import logging
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from router.audit import PrefixAudit, prompt_head
from router.auth import (
    ADMIN_KEY,
    TENANT_KEY,
    AuthConfigError,
    TenantAuth,
    auth_middleware,
    load_tenant_auth,
)
from router.chain_cache import SPAN_BLOCKS, ChainCache, PromptChain
from router.chat_render import UNTRUSTED_TEMPLATE_MESSAGE, TemplateRenderer, has_request_template
from router.config import ConfigError, RouterConfig, load_config
from router.contract import BlockKey, anchor_keys
from router.errors import (
    REQUEST_ID_HEADER,
    BadRequest,
    NoRoutableReplica,
    RequestTimeout,
    RouterError,
)
from router.fleet import Fleet, Replica
from router.fleet_sync import FleetReader, StaticProber, read_fleet_cache
from router.hashing import BlockHasher, HashConfigError
from router.heap import HeapTrimmer
from router.http_errors import error_middleware, openai_parser_errors
from router.logs import REQUEST_ID, configure_logging
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.policy import (
    INDEX_POLICIES,
    Candidate,
    Decision,
    LoadTracker,
    RouteInput,
    decide,
)
from router.prompts import (
    PromptSpec,
    PromptTokenizer,
    parse_prompt,
    parse_token_ids_completion,
)
from router.proxy import (
    REASON_HEADER,
    REPLICA_HEADER,
    STATUS_CLIENT_CLOSED,
    Proxy,
    ProxyOutcome,
    Target,
)
from router.ring import text_key
from router.settings import StartupError
from router.tracing import Tracing, TracingUnavailable, otlp_tracing
from router.ttft import PrefillRateLearner
from router.usage import cached_tokens_from_sse_tail, cached_tokens_from_tail

logger = logging.getLogger(__name__)

GC_GEN0_THRESHOLD = 20_000  # allocations between young-generation collections (CPython: 700)

_JSON = msgspec.json.Decoder()
INLINE_HASH_BLOCKS = 64  # uncached blocks hashed on the event loop (~1.3 us each) before a thread hop
PREFILL_RATE_EWMA_ALPHA = 0.1  # weight of the newest first-byte-per-prefill-token sample
# Lazy hashing: a long prompt is tokenized and hashed before routing only up to the first piece
# holding a block no replica holds (no replica can hit beyond it); the rest in its own thread after
# the request was sent, then recorded as placed (for text, the prompt length used for routing is
# estimated from the tokens per character so far until then). Until then the request's last hashed key is
# a *pending tail*: a request whose chain reaches it waits for the rest to be recorded (at most
# PENDING_TAIL_WAIT_S) and hashes again, so a burst of one new long prefix sees the whole prefix.
# With MAX_QUEUED_RESTS rests waiting for their thread, prompts are hashed whole before routing
# again: the backlog (and the delay of the placements it records) stays bounded under overload.
LAZY_HASHING = True
PENDING_TAIL_WAIT_S = 1.0
MAX_QUEUED_RESTS = 4
SWEEP_KEYS_PER_STEP = 5_000  # index keys swept per event-loop turn (~1 ms)
AUDIT_QUEUE = 64  # template-audit observations waiting at most (more are dropped and counted)
# a client's X-Request-Id is kept only if short and plain (letters, digits, ._:/+=-), else replaced
_REQUEST_ID_OK = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")
CLIENT_LINGER_S = 1.0  # unread request body drained after the answer, at most (aiohttp: 10 s)
INLINE_TOKENIZE_CHARS = 2048  # uncached characters tokenized on the loop (~0.5 ms) before a thread hop


@dataclass(slots=True)
class Routed:
    """A routing decision plus what the proxy needs to count load."""

    decision: Decision
    num_tokens: int
    chain: list[BlockKey]  # block keys; with complete=False only up to the first un-held piece
    targets: list[Target]
    tokenized: bool
    complete: bool = True
    lora: tuple[str, str] | None = None
    write_window_blocks: float = 1.0  # blocks over which recent KV writes decay (``_write_window``)


@dataclass(slots=True)
class _Placed:
    """One dispatch of a request to a replica: the keys recorded as placed there (none outside
    the prefix policy; the rest of a lazy chain joins them when hashed) and the KV writes counted;
    ``withdrawn``: the replica refused the request, place nothing more."""

    keys: list[BlockKey]
    withdrawn: bool = False
    rest: asyncio.Future[PromptChain] | None = None  # the rest being hashed (cancelled if withdrawn)
    blocks: int = 0  # KV writes counted for the request on this replica (``record_writes``)
    ticket: _GaugedTicket | None = None  # its load, corrected when a text's exact length is known


class RouterService:
    """Per-process router state and HTTP handlers."""

    def __init__(self, config: RouterConfig, tokenizer: PromptTokenizer | None,
                 tracing: Tracing | None = None) -> None:
        self.config = config
        self.tracing = tracing or Tracing(None)
        self.hasher = BlockHasher(config.block_size, config.hash_algo, config.hash_seed)
        self.tokenizer = tokenizer
        self.chains = ChainCache(self.hasher, config.token_cache_chunks, config.index_stride,
                                 max_bytes=config.prompt_cache_mib * 3 << 18)  # 3/4 of the MiB
        self.metrics = RouterMetrics()
        self.heap = HeapTrimmer()
        self._tokenize_children: dict[tuple[str, str], Any] = {}
        # {replica_id: EWMA of streamed first-byte seconds per prefill token (incl. queueing)}
        self.prefill_s_per_token: dict[str, float] = {}
        self.fleet = Fleet(config, self.hasher)
        self.tracker = LoadTracker()
        self.params = config.policy_params()
        # the ttft policy's prefill rate per replica, fitted from streamed first-token times
        self.learner = PrefillRateLearner(config.ttft_prior_tokens_per_s)
        self._uses_index = config.policy in INDEX_POLICIES
        self.executor = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        # the rest of lazily hashed prompts: one thread, so that under load it never takes the
        # cores that routing (the event loop and the tokenize threads) needs
        self.rest_executor = ThreadPoolExecutor(1, thread_name_prefix="tokenize-rest")
        # request-supplied chat templates (trusted only): rendered in a child process that is
        # killed on overrun; one thread waits on it so that no tokenizer thread ever does
        self.renderer: TemplateRenderer | None = None
        if config.trust_request_chat_template and tokenizer is not None:
            self.renderer = TemplateRenderer(tokenizer.source, config.chat_template_timeout_s,
                                             config.chat_template_max_bytes)
        self.render_executor = ThreadPoolExecutor(1, thread_name_prefix="chat-template")
        self.rr_counter = 0
        self.reader: FleetReader | None = None
        self.prober: StaticProber | None = None
        self.session: aiohttp.ClientSession | None = None
        self.proxy: Proxy | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # {last key of a lazily hashed chain: done when the rest of that chain is recorded}
        self._pending_tails: dict[int, asyncio.Future[None]] = {}
        self._queued_rests = 0  # rests of lazy chains submitted and not yet recorded
        self.audit: PrefixAudit | None = None
        if config.audit_families:
            decode = tokenizer.backend.decode if tokenizer is not None else None
            self.audit = PrefixAudit(config.block_size, decode, config.audit_families,
                                     config.audit_head_tokens)
            self.metrics.watch_audit(self.audit, config.audit_top_k)
        # the audit's own thread: it never competes with routing for the tokenizer pool
        self.audit_executor = ThreadPoolExecutor(1, thread_name_prefix="audit")
        self._audit_queued = 0  # observations submitted and not yet done
        self.web_server: web.Server | None = None  # the listening server (client connections)
        self.draining = False  # stopping: /ready answers 503 while in-flight requests finish
        self.auth: TenantAuth | None = None
        if config.api_keys:
            self.auth = load_tenant_auth(
                config.api_keys, config.cache_salt_secret_file, config.client_cache_salt,
                config.admin_tenants, config.debug_access, config.metrics_access)

    # -- lifecycle ---------------------------------------------------------------

    def build_app(self) -> web.Application:
        middlewares = [_request_id_middleware, error_middleware]
        if self.auth is not None:
            middlewares.append(auth_middleware(self.auth))
        if self.tracing.enabled:  # outside the error middleware: it sees the status sent
            middlewares.insert(1, self._tracing_middleware)
        app = web.Application(middlewares=middlewares, client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/completions", functools.partial(self.handle_generate, "completion"))
        app.router.add_post("/v1/chat/completions", functools.partial(self.handle_generate, "chat"))
        app.router.add_get("/v1/models", self.handle_models)
        for path in ("/tokenize", "/detokenize", "/v1/embeddings"):
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
                      "prefix_router.request_id": request["request_id"]}
        with self.tracing.server_span(f"{request.method} {request.path}", request.headers,
                                      attributes) as span:
            response = await handler(request)
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _on_startup(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0, enable_cleanup_closed=True)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.proxy = Proxy(self.session, self.config, self.metrics, self.fleet.health,
                           self.tracing)
        if self.config.redis_url:
            # until Redis answers: the last fleet seen there and the configured fallbacks
            added = self.fleet.add_fallbacks(read_fleet_cache(self.config.fleet_cache_file),
                                             self.config.fallback_replicas)
            if added:
                logger.info("%d fallback replicas until Redis gives the fleet", added)
        if self.config.replicas or any(r.fallback for r in self.fleet.replicas.values()):
            self.prober = StaticProber(self.fleet, self.session,
                                       self.config.static_probe_interval_s, self.config.health_failures)
            await self.prober.probe_once()
            self._tasks.append(asyncio.create_task(self.prober.run()))
        if self.config.redis_url:
            self.reader = FleetReader(self.fleet, self.config, self.metrics)
            self._tasks.append(asyncio.create_task(self.reader.run()))
            # listen once the first connection attempt is over: synced, or failed (then the
            # fallback replicas route while the reader retries)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.reader.attempted.wait(), timeout=5.0)
        if self.renderer is not None:
            asyncio.get_running_loop().run_in_executor(self.render_executor, self.renderer.start)
        self._tasks.append(asyncio.create_task(self._housekeeping()))
        self._tasks.append(asyncio.create_task(self._sweeper()))
        self._tasks.append(asyncio.create_task(self._stall_watch()))

    async def _on_cleanup(self, app: web.Application) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.session is not None:
            await self.session.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.rest_executor.shutdown(wait=False, cancel_futures=True)
        self.audit_executor.shutdown(wait=False, cancel_futures=True)
        self.render_executor.shutdown(wait=False, cancel_futures=True)
        if self.renderer is not None:
            self.renderer.close()

    def _close_idle_connections(self) -> int:
        """Close the oldest idle client connections beyond ``max_idle_client_connections``.
        Returns how many were closed. (aiohttp keeps no such bound; ``_waiter`` is set while a
        connection waits for its next request head.)"""
        if self.web_server is None:
            return 0
        idle = [h for h in self.web_server.connections if getattr(h, "_waiter", None) is not None]
        surplus = len(idle) - self.config.max_idle_client_connections
        for handler in idle[:max(surplus, 0)]:  # oldest first
            handler.force_close()
        return max(surplus, 0)

    def _prompt_cache_gauges(self) -> None:
        caches: list[tuple[str, Any]] = [("chain", self.chains)]
        if self.tokenizer is not None:
            caches += [("chunk_tokens", self.tokenizer.cache),
                       ("rendered_chat", self.tokenizer.rendered)]
        for name, cache in caches:
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
            if self.heap.due():  # a large prompt's freed memory back to the OS (router.heap)
                await asyncio.to_thread(self.heap.trim)
            for rid, replica in self.fleet.replicas.items():
                routable = self.fleet.routable_problem(replica, now) is None
                self.metrics.replica_routable.labels(rid).set(1 if routable else 0)
                affinity = self.fleet.affinity_problem(replica) is None
                self.metrics.replica_affinity.labels(rid).set(1 if affinity else 0)
                mismatch = self.fleet.config_mismatch(replica) is not None
                self.metrics.replica_config_mismatch.labels(rid).set(1 if mismatch else 0)
            await asyncio.sleep(1.0)

    async def _stall_watch(self) -> None:
        """Bench replicas that stopped sending bytes while others did (``router.health``) and
        move their requests that still wait for a first byte to the next replica."""
        health = self.fleet.health
        interval = min(1.0, self.config.stall_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for rid in health.stalled(now):
                health.trip(rid, now, "stalled")
                self.metrics.child(self.metrics.upstream_errors, rid, "stalled").inc()
                moved = self.proxy.abort_waiting(rid) if self.proxy is not None else 0
                logger.warning("replica %s sent nothing for %.0f s while others did: benched; "
                               "%d waiting requests moved", rid, self.config.stall_timeout_s, moved)

    async def _sweeper(self) -> None:
        """Sweep retired index slots (replica cleared or dropped) in steps that yield to the loop."""
        while True:
            if self.fleet.index.sweep_pending:
                self.fleet.sweep_index(SWEEP_KEYS_PER_STEP)
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(0.05)

    # -- routing -----------------------------------------------------------------

    def _chain(self, spec: PromptSpec, lora: tuple[str, str] | None,
               inline: bool, lazy: bool = False) -> PromptChain | None:
        """Exact prompt length and block-key chain through the chain cache.

        ``inline`` (on the event loop): returns ``None`` instead of doing more than
        ``INLINE_HASH_BLOCKS`` of hashing or ``INLINE_TOKENIZE_CHARS`` of
        tokenizing; the caller then runs it again in the thread pool. ``lazy``:
        hash (and tokenize) only up to the first piece holding a block no replica
        holds (the result has ``complete=False``, and for text an estimated
        ``num_tokens``; see ``_place_speculative``).
        """
        held = self.fleet.holds_key if lazy else None
        if spec.token_ids is not None:
            uncached, path, pieces = self.chains.uncached_id_blocks(
                spec.token_ids, lora, spec.cache_salt)
            if uncached <= INLINE_HASH_BLOCKS:
                held = None
            elif inline and held is None:
                return None
            root = self.chains.root(lora, spec.cache_salt)
            return self.chains.chain(
                root, pieces, self.chains.id_spans(spec.token_ids), lora, spec.cache_salt,
                path=path, held=held, num_tokens=len(spec.token_ids),
                max_pieces=INLINE_HASH_BLOCKS // SPAN_BLOCKS if held is not None and inline else None)
        assert self.tokenizer is not None
        return self.tokenizer.prompt_chain(spec, self.chains, lora,
                                           INLINE_TOKENIZE_CHARS if inline else None, held)

    def _chain_blocking(self, spec: PromptSpec, lora: tuple[str, str] | None,
                        lazy: bool = False) -> PromptChain:
        chain = self._chain(spec, lora, inline=False, lazy=lazy)
        assert chain is not None
        return chain

    async def _prompt_chain(self, spec: PromptSpec, lora: tuple[str, str] | None,
                            lazy: bool, follow_pending: bool) -> tuple[PromptChain, str]:
        """The chain (inline if cheap, else in the thread pool) and the path taken.

        ``follow_pending``: a chain (lazy or whole) that reaches another request's pending tail is
        computed again once that tail is recorded, within ``PENDING_TAIL_WAIT_S`` in all.
        """
        loop = asyncio.get_running_loop()
        give_up = loop.time() + PENDING_TAIL_WAIT_S
        while True:
            path = "inline"
            inline = self._chain(spec, lora, inline=True, lazy=lazy)
            if inline is not None:
                prompt = inline
            else:
                path = "thread"
                prompt = await loop.run_in_executor(
                    self.executor, self._chain_blocking, spec, lora, lazy)
            pending = self._pending_tails
            if not follow_pending or not pending or pending.keys().isdisjoint(prompt.keys):
                return prompt, path
            wait_s = give_up - loop.time()
            if wait_s <= 0:
                return prompt, path
            keys = set(prompt.keys)
            await asyncio.wait([fut for key, fut in pending.items() if key in keys],
                               timeout=wait_s)

    async def _request_template(self, spec: PromptSpec) -> PromptSpec:
        """A chat request's own ``chat_template``: refused as vLLM does unless
        ``trust_request_chat_template``; when trusted, rendered in the bounded child process
        (``router.chat_render``) and the spec carries the text. Raises ``BadRequest``."""
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

    async def route(self, spec: PromptSpec, *, dry_run: bool = False) -> Routed:
        """Eligibility, tokens, hit depths and the policy decision for one request."""
        now = time.monotonic()
        eligible, lora = self.fleet.eligible(spec.model, now)
        tokenized = spec.token_ids is not None or self.tokenizer is not None
        chain: list[BlockKey] = []
        prompt: PromptChain | None = None
        if tokenized:
            started = time.perf_counter()
            follow = LAZY_HASHING and not dry_run and self._uses_index
            lazy = follow and self._queued_rests < MAX_QUEUED_RESTS
            with self.tracing.span("tokenize_hash") as span:
                prompt, path = await self._prompt_chain(spec, lora, lazy, follow)
                if span is not None:
                    span.set_attributes({"prefix_router.num_tokens": prompt.num_tokens,
                                         "prefix_router.chain_blocks": len(prompt.keys),
                                         "prefix_router.complete": prompt.complete,
                                         "prefix_router.path": path})
            chain = prompt.keys
            self._tokenize_child(spec.kind, path).observe(time.perf_counter() - started)
        elif not dry_run:
            self.metrics.untokenized.labels("no_tokenizer").inc()
        if prompt is not None:
            num_tokens = prompt.num_tokens
            ring_key = text_key(json.dumps(prompt.head)) if prompt.head else 0
        else:
            num_tokens = max(1, len(spec.fallback_text()) // 4)
            ring_key = text_key(spec.fallback_text())
        views = []
        affinity_ids = []
        window = self._write_window(eligible)
        for r in eligible:
            affinity = self.fleet.affinity_problem(r) is None
            if affinity:
                affinity_ids.append(r.replica_id)
            rate = self.learner.estimate(r.replica_id)
            views.append(Candidate(
                r.replica_id, affinity=affinity,
                inflight_requests=self.tracker.requests(r.replica_id),
                inflight_prefill_tokens=self.tracker.prefill_tokens(r.replica_id),
                prefilling_requests=self.tracker.prefilling(r.replica_id),
                engine_running=r.num_running, engine_waiting=r.num_waiting,
                ours_at_heartbeat=(self.tracker.requests_at(r.replica_id, r.heartbeat_ts)
                                   if r.heartbeat_ts else None),
                recent_write_blocks=self.tracker.recent_writes(r.replica_id, window),
                s_per_token=rate.s_per_token, overhead_s=rate.overhead_s))
        confirmed: dict[str, int] = {}
        combined: dict[str, int] = {}
        if chain and self._uses_index:
            mask = self.fleet.index.mask_of(r.replica_id for r in eligible)
            confirmed, combined = self.fleet.index.hit_depths(
                chain, mask, self.fleet.speculative, now)
        request = RouteInput(chain, num_tokens, ring_key, tokenized=tokenized)
        with self.tracing.span("route") as span:
            decision = decide(self.config.policy, request, views,
                              self.fleet.ring(self.fleet.routable(now)),
                              confirmed=confirmed, combined=combined, params=self.params,
                              rr_counter=self.rr_counter,
                              avg_prompt_tokens=self.tracker.avg_prompt_tokens)
            if span is not None:
                span.set_attributes({"prefix_router.policy": self.config.policy,
                                     "prefix_router.replica": decision.replica_id,
                                     "prefix_router.reason": decision.reason,
                                     "prefix_router.hit_blocks": decision.hit_blocks,
                                     "prefix_router.num_eligible": len(eligible)})
        if not dry_run:
            self.rr_counter += 1
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("route %s -> %s (%s) hit=%d/%d tokens=%d details=%s",
                             spec.kind, decision.replica_id, decision.reason, decision.hit_blocks,
                             decision.chain_blocks, num_tokens, decision.details)
        urls = {r.replica_id: r.url for r in eligible}
        size = self.config.block_size
        targets = [Target(rid, urls[rid],
                          decision.hit(rid).confirmed * size)
                   for rid in (decision.replica_id, *decision.fallbacks)]
        return Routed(decision, num_tokens, chain, targets, tokenized,
                      prompt.complete if prompt is not None else True, lora, window)

    def _write_window(self, replicas: Sequence[Replica]) -> float:
        """Blocks over which recent KV writes decay: ``cold_write_window`` x the replicas' summed
        KV capacity (heartbeat ``num_gpu_blocks``, else ``replica_kv_blocks`` each)."""
        capacity = sum(r.num_gpu_blocks or self.config.replica_kv_blocks for r in replicas)
        return max(self.config.cold_write_window * capacity, 1.0)

    def _tokenize_child(self, kind: str, path: str) -> Any:
        child = self._tokenize_children.get((kind, path))
        if child is None:
            child = self._tokenize_children[(kind, path)] = self.metrics.tokenize.labels(kind, path)
        return child

    def _place_speculative(self, routed: Routed, replica_id: str, spec: PromptSpec,
                           lora: tuple[str, str] | None) -> _Placed | None:
        """Record the chain as placed on ``replica_id``; returns what was recorded (a lazy chain's
        rest is hashed in its own thread and added when done, unless withdrawn by then)."""
        if not self._uses_index or not routed.chain:
            return None
        held = routed.decision.hit(replica_id).confirmed
        slot = self.fleet.index.bit(replica_id)
        stride = self.config.index_stride  # only anchor keys are ever looked up
        placed = _Placed(anchor_keys(routed.chain, stride, held))
        self.fleet.speculative.place(slot, placed.keys, time.monotonic())
        if not routed.complete:
            loop = asyncio.get_running_loop()
            done = len(routed.chain)
            boundary = routed.chain[-1]
            recorded: asyncio.Future[None] = loop.create_future()
            self._pending_tails[boundary] = recorded

            def place_rest(fut: asyncio.Future[PromptChain]) -> None:
                self._queued_rests -= 1
                if not fut.cancelled() and fut.exception() is None and not placed.withdrawn:
                    self._correct_length(routed, replica_id, placed, fut.result().num_tokens)
                    rest = anchor_keys(fut.result().keys, stride, done)
                    self.fleet.speculative.place(slot, rest, time.monotonic())
                    placed.keys.extend(rest)
                if self._pending_tails.get(boundary) is recorded:
                    del self._pending_tails[boundary]
                recorded.set_result(None)

            self._queued_rests += 1
            try:
                future = loop.run_in_executor(self.rest_executor, self._chain_blocking, spec, lora)
            except RuntimeError:  # the executor is shut down: the router is stopping
                future = loop.create_future()
                future.cancel()
            future.add_done_callback(place_rest)
            placed.rest = future
        return placed

    def _write_blocks(self, routed: Routed, replica_id: str) -> int:
        """New KV blocks the request makes ``replica_id`` write: its full blocks beyond the hit
        predicted there."""
        hit_blocks = routed.decision.hit(replica_id).blocks
        return max(routed.num_tokens // self.config.block_size - hit_blocks, 0)

    def _correct_length(self, routed: Routed, replica_id: str, placed: _Placed,
                        num_tokens: int) -> None:
        """A lazily tokenized text's exact length is known: correct the estimate in the request's
        KV writes and in its prefill load (if not released yet)."""
        if num_tokens == routed.num_tokens:
            return
        routed.num_tokens = num_tokens
        blocks = self._write_blocks(routed, replica_id)
        if blocks > placed.blocks:
            self.tracker.record_writes(replica_id, blocks - placed.blocks, routed.write_window_blocks)
        elif blocks < placed.blocks:
            self.tracker.withdraw_writes(replica_id, placed.blocks - blocks,
                                         routed.write_window_blocks)
        placed.blocks = blocks
        if placed.ticket is not None:
            hit_blocks = routed.decision.hit(replica_id).blocks
            placed.ticket.resize_prefill(max(num_tokens - hit_blocks * self.config.block_size, 1))

    # -- handlers ----------------------------------------------------------------

    async def _read_json(self, request: web.Request) -> tuple[bytes, Any]:
        body = await _read_body(request, self.config.client_body_timeout_s)
        return body, self._decode_json(body)

    @staticmethod
    def _decode_json(body: bytes) -> Any:
        try:
            return _JSON.decode(body)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc

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

    async def _generate(self, kind: str, request: web.Request,
                        counted: _Counted) -> web.StreamResponse:
        arrival = time.perf_counter()
        body = await _read_body(request, self.config.client_body_timeout_s)
        if self.auth is not None:
            body = self.auth.salted_body(request, body)  # the tenant's cache_salt
        spec = parse_token_ids_completion(body) if kind == "completion" else None
        if spec is None:
            try:
                data = _JSON.decode(body)
            except (msgspec.DecodeError, RecursionError) as exc:
                raise BadRequest(f"request body is not valid JSON: {exc}") from exc
            spec = parse_prompt(kind, data)
        spec = await self._request_template(spec)
        routed = await self.route(spec)
        decision = routed.decision
        hit_tokens = decision.hit_blocks * self.config.block_size
        prefill = max(routed.num_tokens - hit_tokens, 1)
        endpoint = request.path
        status = 500
        replica_id = counted.replica_id = decision.replica_id
        counted.reason = decision.reason

        def start_ticket(rid: str) -> Any:
            ticket = self.tracker.dispatch(rid, prefill)
            self._update_inflight(rid)
            gauged = tickets[rid] = _GaugedTicket(ticket, self)
            if not spec.stream:
                # the first byte of a non-streamed answer comes only at the end: release its
                # prefill at the time streamed requests to this replica took per prefill token
                per_token = self.prefill_s_per_token.get(rid)
                if per_token is not None:
                    gauged.release_prefill_after(per_token * prefill)
            return gauged

        sent: list[tuple[str, _Placed]] = []  # (replica, what was placed and written there)
        tickets: dict[str, _GaugedTicket] = {}
        sent_at: dict[str, float] = {}  # {replica_id: perf_counter at its (last) dispatch}

        def on_sent(rid: str) -> None:
            sent_at[rid] = time.perf_counter()
            self.metrics.child(self.metrics.overhead, endpoint).observe(time.perf_counter() - arrival)
            placed = self._place_speculative(routed, rid, spec, routed.lora) or _Placed([])
            placed.blocks, placed.ticket = self._write_blocks(routed, rid), tickets.get(rid)
            self.tracker.record_writes(rid, placed.blocks, routed.write_window_blocks)
            sent.append((rid, placed))

        def on_failure(rid: str) -> None:
            self.fleet.mark_failed(rid, time.monotonic())

        assert self.proxy is not None
        try:
            response, outcome = await self.proxy.forward(
                request, endpoint, body, routed.targets, decision.reason, request["request_id"],
                start_ticket, on_failure, arrival, on_sent, streamed=spec.stream)
            status, replica_id = outcome.status, outcome.replica_id
            counted.status, counted.replica_id = status, replica_id
            if spec.stream and outcome.first_byte_s is not None and status == 200:
                sample = outcome.first_byte_s / prefill
                old = self.prefill_s_per_token.get(replica_id)
                self.prefill_s_per_token[replica_id] = sample if old is None else (
                    old + PREFILL_RATE_EWMA_ALPHA * (sample - old))
            if spec.stream and outcome.first_byte_s is not None and status == 200:
                # a non-streamed answer's first byte is the whole answer: not a TTFT
                self._observe_ttft(spec, decision, outcome)
                self._observe_first_token(decision, replica_id,
                                          arrival + outcome.first_byte_s - sent_at[replica_id])
            predicted_hit = hit_tokens if replica_id == decision.replica_id else 0
            self.metrics.child(self.metrics.prompt_tokens, replica_id).inc(routed.num_tokens)
            self.metrics.child(self.metrics.predicted_hit_tokens, replica_id).inc(predicted_hit)
            if status == 200:
                self._audit_request(spec, routed.num_tokens, predicted_hit, outcome,
                                    request.get(TENANT_KEY))
            return response
        except RouterError as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            # attempts that failed, and an answer refusing the request, left no blocks on the
            # replica: their placements are withdrawn. A refusal of the request itself (a 4xx,
            # e.g. a prompt over the context length) and a stale connection's repeat withdraw
            # their KV writes too; a replica failure (5xx, connection, timeout) counts its writes
            # twice, so a replica failing every request never looks the emptiest (cold placement
            # prefers the fewest recent writes) even against the replica that then served it
            refused = status >= 400 and status != STATUS_CLIENT_CLOSED
            last = len(sent) - 1
            for i, (rid, placed) in enumerate(sent):
                served = not refused and rid == replica_id
                if served and i == last:
                    continue
                placed.withdrawn = True
                if placed.rest is not None:
                    placed.rest.cancel()  # not hashed yet: never will be
                repeated = any(other == rid for other, _ in sent[i + 1:])
                if repeated or (i == last and refused and status < 500):
                    self.tracker.withdraw_writes(rid, placed.blocks, routed.write_window_blocks)
                elif i < last or refused:
                    self.tracker.record_writes(rid, placed.blocks, routed.write_window_blocks)
                slot = self.fleet.index.slot_of(rid)
                if placed.keys and slot is not None and not served:
                    # (a retry re-placed the same keys)
                    self.fleet.speculative.withdraw(slot, placed.keys)

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

    def _observe_first_token(self, decision: Decision, replica_id: str, ttft_s: float) -> None:
        """A streamed request's first byte came ``ttft_s`` after its dispatch to ``replica_id``:
        teach the prefill-rate learner, and record how far off the ttft policy's prediction was."""
        predicted = decision.predictions.get(replica_id)
        if predicted is None:  # another policy: nothing predicted
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
            audit.dropped += 1
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
        self.metrics.child(self.metrics.inflight, replica_id).set(self.tracker.requests(replica_id))
        self.metrics.child(self.metrics.inflight_prefill, replica_id).set(self.tracker.prefill_tokens(replica_id))

    async def handle_passthrough(self, request: web.Request) -> web.StreamResponse:
        """``/tokenize``, ``/detokenize``, ``/v1/embeddings``: least-loaded replica serving the model."""
        arrival = time.perf_counter()
        body, data = await self._read_json(request)
        model = data.get("model") if isinstance(data, dict) else None
        if model is not None and not isinstance(model, str):
            raise BadRequest("'model' must be a string")
        now = time.monotonic()
        eligible, _ = self.fleet.eligible(model, now)
        views = [Candidate(r.replica_id, inflight_requests=self.tracker.requests(r.replica_id),
                             engine_running=r.num_running, engine_waiting=r.num_waiting)
                 for r in eligible]
        decision = decide("least_loaded", RouteInput([], 0, 0), views, self.fleet.ring(eligible),
                          rr_counter=self.rr_counter)
        self.rr_counter += 1
        urls = {r.replica_id: r.url for r in eligible}
        targets = [Target(rid, urls[rid]) for rid in (decision.replica_id, *decision.fallbacks)]
        assert self.proxy is not None
        status = 500
        try:
            response, outcome = await self.proxy.forward(
                request, request.path, body, targets, decision.reason, request["request_id"],
                lambda rid: _GaugedTicket(self.tracker.dispatch(rid, 0), self),
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
        """Union of the routable replicas' models; 503 when none is routable (an empty list
        would tell a client the router serves no model at all)."""
        now = time.monotonic()
        if not self.fleet.routable(now):
            raise NoRoutableReplica("no routable replica: the served models are unknown" if not
                                    self.fleet.replicas else "no routable replica")
        return web.json_response({"object": "list", "data": self.fleet.model_cards(now)})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_ready(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        replicas = []
        for rid in sorted(self.fleet.replicas):
            r = self.fleet.replicas[rid]
            problem = self.fleet.routable_problem(r, now)
            affinity_problem = self.fleet.affinity_problem(r)
            replicas.append({
                "replica_id": rid, "url": r.url, "static": r.static, "routable": problem is None,
                "not_routable_reason": problem, "affinity": affinity_problem is None,
                "no_affinity_reason": affinity_problem, "hash_verified": r.hash_verified,
                "config_mismatch": self.fleet.config_mismatch(r), "index_stride": r.index_stride,
                "epoch": r.epoch, "models": sorted(r.models) if r.models is not None else None,
                "lora_adapters": sorted(r.lora_adapters), "num_running": r.num_running,
                "num_waiting": r.num_waiting, "kv_usage": r.kv_usage,
                "index_blocks": self.fleet.index.num_blocks(rid),
                "circuit": self.fleet.health.state(rid),
                "inflight_requests": self.tracker.requests(rid),
                "inflight_prefill_tokens": self.tracker.prefill_tokens(rid),
            })
        ready = any(item["routable"] for item in replicas) and not self.draining
        body = {"ready": ready, "draining": self.draining, "policy": self.config.policy,
                "redis": None if self.reader is None else {"connected": self.reader.connected,
                                                           "last_stream_id": self.reader.last_id},
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
        data = self._decode_json(body)
        kind = "chat" if isinstance(data, dict) and "messages" in data else "completion"
        spec = parse_prompt(kind, data)
        routed = await self.route(await self._request_template(spec), dry_run=True)
        d = routed.decision
        return web.json_response({
            "kind": kind, "policy": self.config.policy, "tokenized": routed.tokenized,
            "num_tokens": routed.num_tokens, "chain_blocks": len(routed.chain),
            "block_size": self.config.block_size, "replica": d.replica_id, "reason": d.reason,
            "hit_blocks": d.hit_blocks, "hit_tokens": d.hit_blocks * self.config.block_size,
            "fallbacks": list(d.fallbacks), "replicas": d.details,
            "load": self.tracker.snapshot(),
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


class _GaugedTicket:
    """A ``LoadTicket`` that refreshes the in-flight gauges when released.

    ``release_prefill_after(delay_s)`` releases the prefill part early, at an
    estimated first-token time (non-streamed requests, whose first byte is the
    whole answer); the timer is cancelled when the ticket is released otherwise.
    """

    __slots__ = ("_service", "_ticket", "_timer", "replica_id")

    def __init__(self, ticket: Any, service: RouterService) -> None:
        self._ticket = ticket
        self._service = service
        self._timer: asyncio.TimerHandle | None = None
        self.replica_id = ticket.replica_id

    def release_prefill_after(self, delay_s: float) -> None:
        self._timer = asyncio.get_running_loop().call_later(delay_s, self._estimated_first_token)

    def resize_prefill(self, prefill_tokens: int) -> None:
        self._ticket.resize_prefill(prefill_tokens)
        self._service._update_inflight(self.replica_id)

    def _estimated_first_token(self) -> None:
        self._timer = None
        self._ticket.first_token()
        self._service._update_inflight(self.replica_id)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def first_token(self) -> None:
        self._cancel_timer()
        self._ticket.first_token()
        self._service._update_inflight(self.replica_id)

    def finish(self) -> None:
        self._cancel_timer()
        self._ticket.finish()
        self._service._update_inflight(self.replica_id)



@web.middleware
async def _request_id_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    request_id = request.headers.get(REQUEST_ID_HEADER, "")
    if not _REQUEST_ID_OK.fullmatch(request_id):  # reflected and logged: bounded and plain
        request_id = uuid.uuid4().hex
    request["request_id"] = request_id
    REQUEST_ID.set(request_id)  # for every log line while serving it (the handler's own task)
    response = await handler(request)
    if REQUEST_ID_HEADER not in response.headers and not response.prepared:
        response.headers[REQUEST_ID_HEADER] = request_id
    return response


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



def _write_ready_file(path: str, url: str) -> None:
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"url": url}))
    os.replace(tmp, target)


async def serve(config: RouterConfig, tokenizer: PromptTokenizer | None,
                tracing: Tracing | None = None) -> None:
    """Run the router until SIGINT/SIGTERM."""
    service = RouterService(config, tokenizer, tracing)
    app = service.build_app()
    # keepalive_timeout closes a client connection idle that long, counted from its start or its
    # last response, so also one that dribbles its request head (slowloris; aiohttp 3.14);
    # after an answer to an unread body (408, 413) aiohttp reads on for lingering_time
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=config.client_idle_timeout_s,
                           lingering_time=CLIENT_LINGER_S)
    await runner.setup()
    assert runner.server is not None
    openai_parser_errors(runner.server)
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
        _write_ready_file(config.ready_file, url)
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
    except (ConfigError, HashConfigError, AuthConfigError) as exc:
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
    loop_factory = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        logger.info("uvloop not available; using asyncio's default loop")
    # Start-up objects (transformers, the tokenizer) never die: keep them out of the cyclic
    # collector's scans, and collect the young generation less often, since a request
    # allocates thousands of short-lived containers (chain pieces, headers, JSON).
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        try:
            runner.run(serve(config, tokenizer, tracing))
        except StartupError as exc:
            print(f"prefix-router serve: error: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            tracing.shutdown()  # flush the last spans
    return 0
