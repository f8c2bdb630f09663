"""Step 3 of the request path: routing one request, as numbered calls. Pure (asyncio only).

``RequestRouter.route(spec)`` takes a parsed request to a ``Routed``: the policy's typed
``Decision`` (with every candidate's hit depth) and the ``Target`` list the proxy tries in order.
The steps, each one call (the shape of llm-d's indexer read path):

1. eligible replicas for the request's model (and its LoRA adapter), ``Fleet.eligible``; for
   a LoRA adapter, those where it is loaded (else those with a free LoRA slot),
   ``router.apis.lora_load.prefer_loaded``;
2. the prompt's block-key chain, ``PromptChainer.chain`` (lazy for long new prompts);
3. the candidates' loads (the router's own in-flight counts, the engines' heartbeats, recent KV
   writes, learned prefill rates), ``candidates``;
4. every candidate's prefix hit depth in the index (worker-confirmed, and with the router's
   speculative placements), ``BlockIndex.hit_depths``, continued by its CPU tier,
   ``BlockIndex.tier_depths``;
5. the policy's decision, ``router.decision.policy.decide``, kept on the session's replica
   for a request naming a session (``router.traffic.sessions``), ``session``;
6. the targets in retry order, with the engine-confirmed hit there, ``targets``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from router.apis.lora_load import TIER_RANK, LoraPreference, prefer_loaded
from router.decision.fleet import Fleet, Replica
from router.decision.load import LoadTracker
from router.decision.policy import (
    INDEX_POLICIES,
    Candidate,
    Decision,
    RouteInput,
    decide,
    keep_session,
    session_replica,
)
from router.decision.ring import text_key
from router.decision.ttft import PrefillRateLearner
from router.observability.metrics import RouterMetrics
from router.observability.tracing import Tracing
from router.request.chain_cache import PromptChain
from router.request.prompt_path import Lora, PromptChainer
from router.request.prompts import PromptSpec, estimated_tokens
from router.service.config import RouterConfig
from router.shared.contract import BlockKey
from router.traffic.sessions import SessionTable, session_key

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Target:
    """One candidate replica for an attempt."""

    replica_id: str
    url: str  # base URL, no trailing slash
    confirmed_hit_tokens: int = 0  # engine-confirmed prefix hit the index predicts there
    dp_rank: int | None = None  # the engine's DP rank to select (X-data-parallel-rank); None: none


@dataclass(slots=True)
class Routed:
    """A routing decision plus what dispatch and the proxy need.

    ``chain`` holds block keys (with ``complete=False`` only up to the first un-held piece: the
    rest is hashed after dispatch, ``PromptChainer.hash_rest``); ``num_tokens`` is the prompt's
    length (estimated for a lazily tokenized text until its rest is known);
    ``write_window_blocks`` the blocks over which recent KV writes decay.
    """

    decision: Decision
    num_tokens: int
    chain: list[BlockKey]
    targets: list[Target]
    tokenized: bool
    complete: bool = True
    lora: Lora = None
    write_window_blocks: float = 1.0
    lora_affinity: LoraPreference | None = None  # a LoRA request's replica tiers (step 1)
    session_key: int | None = None  # the request's session (router.traffic.sessions), if any
    session_replica: str | None = None  # where the session belonged (kept there or not)


class RequestRouter:
    """Routes requests among the fleet (see the module docstring for the steps)."""

    def __init__(self, config: RouterConfig, fleet: Fleet, tracker: LoadTracker,
                 learner: PrefillRateLearner, chainer: PromptChainer, metrics: RouterMetrics,
                 tracing: Tracing) -> None:
        self.config = config
        self.fleet = fleet
        self.tracker = tracker
        self.learner = learner
        self.chainer = chainer
        self.metrics = metrics
        self.tracing = tracing
        self.params = config.policy_params()
        self.uses_index = config.policy in INDEX_POLICIES
        self.rr_counter = 0  # rotates round_robin and least_loaded's ties
        self._tokenize_children: dict[tuple[str, str], Any] = {}
        self.sessions = SessionTable(config.session_affinity_max_sessions,
                                     config.session_affinity_ttl_s)

    async def route(self, spec: PromptSpec, *, dry_run: bool = False,
                    has_room: Callable[[str], bool] | None = None,
                    session_id: str | None = None) -> Routed:
        """Route ``spec``; ``dry_run`` (``/debug/route``): hash whole, count nothing, remember
        no session; ``has_room(replica_id)``: admission's per-replica limits (only replicas with
        room are candidates, unless none has); ``session_id``: the ``x-session-id`` header.
        Raises ``ModelNotFound`` / ``NoRoutableReplica`` (step 1)
        and ``PromptError`` (step 2)."""
        now = time.monotonic()
        eligible, lora, panic = self.fleet.eligible(spec.model, now)  # 1
        if has_room is not None:
            # admitted on some replica's room: never onto a replica at its limit; none with room
            # (it filled between admission and now) leaves every one as today
            eligible = [r for r in eligible if has_room(r.replica_id)] or eligible
        if panic and not dry_run:
            self.metrics.panic_requests.inc()
        preference, others = None, []
        if lora is not None:  # where the adapter is loaded, else a free slot
            preference = prefer_loaded(lora[0], {r.replica_id: r.lora for r in eligible})
            preferred = set(preference.preferred)
            others = sorted((r for r in eligible if r.replica_id not in preferred),
                            key=lambda r: TIER_RANK[preference.tiers[r.replica_id]])
            eligible = [r for r in eligible if r.replica_id in preferred]
        prompt = await self.prompt_chain(spec, lora, dry_run)  # 2
        window = self.write_window(eligible)
        candidates = self.candidates(eligible, window)  # 3
        chain = prompt.keys if prompt is not None else []
        confirmed, combined, tiered = self.hit_depths(chain, eligible, now)  # 4
        if prompt is not None:
            # the ring key of a prompt shorter than one block (the policies use the chain's keys
            # otherwise, so it is computed only then)
            head_key = text_key(json.dumps(prompt.head)) if prompt.head and not chain else 0
            request = RouteInput(chain, prompt.num_tokens, head_key)
        else:  # no tokenizer: a length estimate and the text's ring position
            request = RouteInput([], estimated_tokens(spec.fallback_text()),
                                 text_key(spec.fallback_text()), tokenized=False)
        decision = self.decide(request, candidates, now, confirmed, combined,
                               len(eligible), count=not dry_run, tiered=tiered)  # 5
        session = (session_key(session_id, spec.session_key, spec.cache_salt)
                   if self.sessions.enabled else None)
        home = None
        if session is not None:
            decision, home = self.session(decision, candidates, session, now, remember=not dry_run)
        # 6; a LoRA request's other replicas follow, by tier: a retry still has somewhere to go
        targets = [*self.targets(decision, eligible),
                   *(Target(r.replica_id, r.url, dp_rank=r.dp_rank) for r in others)]
        return Routed(decision, request.num_tokens, chain, targets, request.tokenized,
                      prompt.complete if prompt is not None else True, lora, window, preference,
                      session, home)

    async def prompt_chain(self, spec: PromptSpec, lora: Lora,
                           dry_run: bool) -> PromptChain | None:
        """Step 2: the chain (``None`` for text without a tokenizer), timed per path."""
        if not self.chainer.tokenizes(spec):
            if not dry_run:
                self.metrics.untokenized.labels("no_tokenizer").inc()
            return None
        started = time.perf_counter()
        with self.tracing.span("tokenize_hash") as span:
            prompt, path = await self.chainer.chain(spec, lora,
                                                    lazy=not dry_run and self.uses_index)
            if span is not None:
                span.set_attributes({"prefix_router.num_tokens": prompt.num_tokens,
                                     "prefix_router.chain_blocks": len(prompt.keys),
                                     "prefix_router.complete": prompt.complete,
                                     "prefix_router.path": path})
        self._tokenize_child(spec.kind, path).observe(time.perf_counter() - started)
        return prompt

    def candidates(self, eligible: Sequence[Replica], window: float) -> list[Candidate]:
        """Step 3: what the policy knows of each eligible replica's load."""
        tracker = self.tracker
        out = []
        for r in eligible:
            rid = r.replica_id
            rate = self.learner.estimate(rid)
            out.append(Candidate(
                rid, affinity=self.fleet.affinity_problem(r) is None,
                inflight_requests=tracker.requests(rid),
                inflight_prefill_tokens=tracker.prefill_tokens(rid),
                prefilling_requests=tracker.prefilling(rid),
                engine_running=r.num_running, engine_waiting=r.num_waiting,
                ours_at_heartbeat=(tracker.requests_at(rid, r.heartbeat_ts)
                                   if r.heartbeat_ts else None),
                recent_write_blocks=tracker.recent_writes(rid, window),
                s_per_token=rate.s_per_token, overhead_s=rate.overhead_s,
                inflight_context_tokens=tracker.context_tokens(rid)))
        return out

    def hit_depths(self, chain: list[BlockKey], eligible: Sequence[Replica],
                   now: float) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Step 4: ``(confirmed, combined, tiered)`` hit depths in blocks per replica id: GPU
        tier confirmed, with speculative placements, and that continued by the CPU tier (empty
        outside the index policies)."""
        if not chain or not self.uses_index:
            return {}, {}, {}
        index = self.fleet.index
        mask = index.mask_of(r.replica_id for r in eligible)
        confirmed, combined = index.hit_depths(chain, mask, self.fleet.speculative, now)
        return confirmed, combined, index.tier_depths(chain, combined)

    def decide(self, request: RouteInput, candidates: list[Candidate], now: float,
               confirmed: dict[str, int], combined: dict[str, int], num_eligible: int,
               count: bool, tiered: dict[str, int] | None = None) -> Decision:
        """Step 5: the configured policy's decision (``count``: advance round-robin)."""
        with self.tracing.span("route") as span:
            decision = decide(self.config.policy, request, candidates,
                              self.fleet.ring(self.fleet.routable(now)),
                              confirmed=confirmed, combined=combined, tiered=tiered,
                              params=self.params,
                              rr_counter=self.rr_counter,
                              avg_prompt_tokens=self.tracker.avg_prompt_tokens,
                              avg_output_tokens=self.tracker.avg_output_tokens)
            if span is not None:
                span.set_attributes({"prefix_router.policy": self.config.policy,
                                     "prefix_router.replica": decision.replica_id,
                                     "prefix_router.reason": decision.reason,
                                     "prefix_router.hit_blocks": decision.hit_blocks,
                                     "prefix_router.num_eligible": num_eligible})
        if count:
            self.rr_counter += 1
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("route -> %s (%s) hit=%d/%d tokens=%d details=%s",
                             decision.replica_id, decision.reason, decision.hit_blocks,
                             decision.chain_blocks, request.num_tokens, decision.details)
        return decision

    def session(self, decision: Decision, candidates: list[Candidate], key: int, now: float,
                remember: bool) -> tuple[Decision, str]:
        """Step 5, for a request of session ``key``: the decision kept on the session's replica
        (the one that last served it, else its ring owner) while that one holds the session's
        prefix and is not overloaded (``keep_session``), and that replica; ``remember``: the
        chosen replica now serves the session."""
        ring = self.fleet.ring(self.fleet.routable(now))
        home = session_replica(ring, key, candidates, self.sessions.replica(key))
        decision = keep_session(decision, candidates, home, self.params, self.config.policy)
        if remember:
            self.sessions.served(key, decision.replica_id)
        return decision, home

    def served(self, routed: Routed, replica_id: str) -> None:
        """``replica_id`` answered ``routed`` (a fallback, maybe): its session lives there now."""
        if routed.session_key is not None and replica_id != routed.decision.replica_id:
            self.sessions.served(routed.session_key, replica_id)

    def targets(self, decision: Decision, eligible: Sequence[Replica]) -> list[Target]:
        """Step 6: the chosen replica, then the fallbacks, with the confirmed hit there."""
        by_id = {r.replica_id: r for r in eligible}
        size = self.config.block_size
        return [Target(rid, by_id[rid].url, decision.hit(rid).confirmed * size, by_id[rid].dp_rank)
                for rid in (decision.replica_id, *decision.fallbacks)]

    def least_loaded(self, model: str | None) -> tuple[Decision, list[Target]]:
        """The least-loaded replica serving ``model`` (``/tokenize``, ``/detokenize``,
        ``/v1/embeddings``: nothing to hit). Raises ``ModelNotFound`` / ``NoRoutableReplica``."""
        now = time.monotonic()
        eligible, _, panic = self.fleet.eligible(model, now)
        if panic:
            self.metrics.panic_requests.inc()
        candidates = [Candidate(r.replica_id, inflight_requests=self.tracker.requests(r.replica_id),
                                engine_running=r.num_running, engine_waiting=r.num_waiting)
                      for r in eligible]
        decision = decide("least_loaded", RouteInput([], 0, 0), candidates,
                          self.fleet.ring(eligible), rr_counter=self.rr_counter)
        self.rr_counter += 1
        by_id = {r.replica_id: r for r in eligible}
        return decision, [Target(rid, by_id[rid].url, dp_rank=by_id[rid].dp_rank)
                          for rid in (decision.replica_id, *decision.fallbacks)]

    def write_window(self, replicas: Sequence[Replica]) -> float:
        """Blocks over which recent KV writes decay: ``cold_write_window`` x the replicas' summed
        KV capacity (heartbeat ``num_gpu_blocks``, else ``replica_kv_blocks`` each)."""
        capacity = sum(r.num_gpu_blocks or self.config.replica_kv_blocks for r in replicas)
        return max(self.config.cold_write_window * capacity, 1.0)

    def _tokenize_child(self, kind: str, path: str) -> Any:
        child = self._tokenize_children.get((kind, path))
        if child is None:
            child = self._tokenize_children[(kind, path)] = self.metrics.tokenize.labels(kind, path)
        return child
