"""The router's own endpoints: ``/v1/models``, ``/health``, ``/ready``, ``/metrics`` and the
debug views ``/debug/route`` (a decision without sending) and ``/debug/prefixes`` (the template
audit). HTTP edge; read-only views of the process's state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from router.apis.aliases import AliasTable
from router.decision.fleet import Fleet, Replica
from router.decision.load import LoadTracker
from router.decision.ttft import PrefillRateLearner
from router.edges.auth import ADMIN_KEY, TENANT_KEY, TenantAuth
from router.edges.fleet_sync import FleetReader
from router.observability.audit import PrefixAudit
from router.observability.metrics import CONTENT_TYPE, RouterMetrics
from router.request.errors import BadRequest, NoRoutableReplica
from router.request.prompts import PromptTokenizer
from router.request.routing import RequestRouter, Routed
from router.service.config import RouterConfig
from router.service.fleet_admission import FleetAdmission
from router.service.request_parse import API_PATHS, RequestParser
from router.service.warm_up import WarmUp
from router.shared.contract import TIER_CPU
from router.traffic.sessions import SESSION_HEADER


class StatusHandlers:
    """Handlers of the router's own endpoints. ``reader`` is set when the router starts (with
    Redis), ``draining`` when it stops (/ready answers 503 while in-flight requests finish)."""

    def __init__(self, config: RouterConfig, fleet: Fleet, tracker: LoadTracker,
                 router: RequestRouter, learner: PrefillRateLearner, aliases: AliasTable,
                 parser: RequestParser, admission: FleetAdmission, warm_up: WarmUp,
                 metrics: RouterMetrics, update_inflight: Callable[[str], None],
                 tokenizer: PromptTokenizer | None, auth: TenantAuth | None,
                 audit: PrefixAudit | None) -> None:
        self.config = config
        self.fleet = fleet
        self.tracker = tracker
        self.router = router
        self.learner = learner
        self.aliases = aliases
        self.parser = parser
        self.admission = admission
        self.gate = admission.gate
        self.warm_up = warm_up
        self.metrics = metrics
        self.update_inflight = update_inflight
        self.tokenizer = tokenizer
        self.auth = auth
        self.audit = audit
        self.reader: FleetReader | None = None
        self.draining = False

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

    def _replica_state(self, r: Replica, now: float, routed: set[str]) -> dict[str, Any]:
        """One replica's entry in /ready's ``replicas``."""
        rid, fleet = r.replica_id, self.fleet
        # /ready needs no key: with API keys on, which adapters tenants use now stays unnamed
        names = self.auth is None
        problem = fleet.routable_problem(r, now)
        affinity_problem = fleet.affinity_problem(r)
        return {
            "replica_id": rid, "url": r.url, "dp_rank": r.dp_rank, "static": r.static,
            "routable": problem is None,
            "not_routable_reason": problem, "affinity": affinity_problem is None,
            "no_affinity_reason": affinity_problem, "hash_verified": r.hash_verified,
            "config_mismatch": fleet.config_mismatch(r), "index_stride": r.index_stride,
            "epoch": r.epoch, "models": sorted(r.models) if r.models is not None else None,
            "lora_adapters": sorted(r.lora_adapters), "lora": None if r.lora is None else {
                "running": sorted(r.lora.running) if names else None,
                "waiting": sorted(r.lora.waiting) if names else None,
                "num_running": len(r.lora.running), "num_waiting": len(r.lora.waiting),
                "max_lora": r.lora.max_lora}, "num_running": r.num_running,
            "num_waiting": r.num_waiting, "kv_usage": r.kv_usage,
            "index_blocks": fleet.index.num_blocks(rid),
            "index_cpu_blocks": fleet.index.num_blocks(rid, TIER_CPU),
            "kv_tiers": list(r.kv_tiers),
            "circuit": fleet.health.state(rid),
            "routed": rid in routed,  # requests go there now (in panic mode: unroutable too)
            "refused_connections": fleet.health.refused(rid, now),
            "inflight_requests": self.tracker.requests(rid),
            "inflight_prefill_tokens": self.tracker.prefill_tokens(rid),
        }

    async def handle_ready(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        routed = {r.replica_id for r in self.fleet.routed(now)}
        replicas = [self._replica_state(self.fleet.replicas[rid], now, routed)
                    for rid in sorted(self.fleet.replicas)]
        panic, num_routable, num_replicas = self.fleet.panic(now)
        # in panic mode the router routes to replicas /ready lists as not routable ("routed")
        not_ready = self.fleet.not_ready(now)
        ready = not_ready is None and not self.draining and not self.warm_up.warming
        reader = self.reader
        body = {"ready": ready, "not_ready_reason": not_ready,
                "draining": self.draining, "warm_up": self.warm_up.state(),
                "admission": self.gate.state(),
                "policy": self.config.policy,
                "panic": {"active": panic, "routable_replicas": num_routable,
                          "replicas": num_replicas, "threshold": self.config.panic_threshold},
                "redis": None if reader is None else {
                    "connected": reader.connected, "last_stream_id": reader.last_id,
                    # writes refused for lack of memory: routing goes on, the index lags
                    "oom": reader.oom,
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
            self.update_inflight(rid)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def handle_debug_route(self, request: web.Request) -> web.Response:
        """The decision for a generate body (``?api=responses|messages`` for those APIs'),
        without sending it (with API keys on, under the caller's tenant salt: a tenant sees only
        its own prefixes); ``?token_ids=1`` adds the prompt's token ids."""
        body = await self.parser.read(request)
        kind = request.query.get("api", "")  # responses | messages: that API's body
        if kind not in API_PATHS:
            data = body.data()
            kind = "chat" if isinstance(data, dict) and "messages" in data else "completion"
        # an alias: where the next request naming it would go (its split does not advance)
        spec = (await self.parser.parse_body(kind, body, request, advance=False)).spec
        routed = await self.router.route(spec, dry_run=True,
                                         session_id=request.headers.get(SESSION_HEADER))
        extra: dict[str, Any] = {}
        if request.query.get("token_ids") in ("1", "true") and self.tokenizer is not None:
            # the prompt's token ids as the router computes them (to hold against the engine's
            # own /tokenize); only on request: a long prompt's ids are a large answer
            extra["token_ids"] = await asyncio.get_running_loop().run_in_executor(
                self.router.chainer.executor, self.tokenizer.prompt_tokens, spec)
        terms = self.admission.terms(spec, request)  # the class, work and TTFT target it has
        return web.json_response({**extra, "kind": kind, "model": spec.model,
                                  **self._decision_view(routed, spec.model, terms)})

    def _decision_view(self, routed: Routed, model: str | None,
                       terms: tuple[int, float, float | None]) -> dict[str, Any]:
        """/debug/route's view of ``routed``: the decision, its candidates and targets, the
        loads and the admission state it was made with."""
        d = routed.decision
        block_size = self.config.block_size
        return {
            "policy": self.config.policy, "tokenized": routed.tokenized,
            "lora_affinity": None if routed.lora_affinity is None else {
                "adapter": routed.lora_affinity.adapter, "tier": routed.lora_affinity.tier,
                "replicas": dict(routed.lora_affinity.tiers)},
            "num_tokens": routed.num_tokens, "chain_blocks": len(routed.chain),
            "block_size": block_size, "replica": d.replica_id, "reason": d.reason,
            "hit_blocks": d.hit_blocks, "hit_tokens": d.hit_blocks * block_size,
            "cpu_hit_blocks": d.hit(d.replica_id).cpu_blocks,
            "fallbacks": list(d.fallbacks), "replicas": d.details,
            # the session's replica (x-session-id / prompt_cache_key), kept or left
            "session_replica": routed.session_replica,
            # where each candidate's attempt would go: engine URL and DP rank (vLLM header)
            "targets": {t.replica_id: {"url": t.url, "dp_rank": t.dp_rank}
                        for t in routed.targets},
            "load": self.tracker.snapshot(),
            # whether the request would wait for room now, and why (router/traffic)
            "admission": {**self.gate.state(), **self.gate.explain(model, *terms)},
            # the typical lengths standing in for load this router cannot count (ttft policy)
            "avg_prompt_tokens": round(self.tracker.avg_prompt_tokens, 1),
            "avg_output_tokens": round(self.tracker.avg_output_tokens, 1),
            "prefill_rates": {
                rid: {"tokens_per_s": round(est.tokens_per_s, 1),
                      "overhead_s": round(est.overhead_s, 6), "samples": est.num_samples}
                for rid in d.details for est in (self.learner.estimate(rid),)},
        }

    async def handle_debug_prefixes(self, request: web.Request) -> web.Response:
        """The template audit: top prefix families (``?top=K``), near misses, block-boundary
        waste, hit rate per family. With API keys on, a tenant that is not an admin sees only
        its own families."""
        if self.audit is None:
            return web.json_response({"enabled": False, "families": []})
        try:
            top = int(request.query.get("top", self.config.audit_top_k))
        except ValueError as exc:
            raise BadRequest("'top' must be an integer") from exc
        everyone = self.auth is None or bool(request.get(ADMIN_KEY))
        body = self.audit.report(top, tenant=request.get(TENANT_KEY), all_tenants=everyone)
        return web.json_response({"enabled": True, **body})
