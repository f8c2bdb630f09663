"""The request path's admission step: the tenant's rate limits, then the bounded queue in front
of the fleet (``router.traffic.gate``) fed with this router's loads per replica, and vLLM's
``priority`` set on the body from the request's class when forwarding is on. Wiring of the
``router.traffic`` pieces to the fleet and the load tracker; the waits are its only I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from router.decision.fleet import Fleet
from router.decision.load import LoadTracker
from router.decision.ttft import PrefillRateLearner, prefill_work_tokens
from router.edges.auth import TENANT_KEY
from router.edges.http_errors import REQUEST_ID_KEY
from router.observability.metrics import RouterMetrics
from router.request.errors import RouterError
from router.request.prompts import PromptSpec, estimated_tokens
from router.service.config import RouterConfig
from router.service.request_parse import ParsedRequest
from router.shared.redis_client import redis_client
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


def traffic_classes(config: RouterConfig) -> PriorityClasses:
    """The priority classes with the tenant file's settings. Raises ``TenantFileError``."""
    tenants = (load_tenant_file(config.admission_tenants_file)
               if config.admission_tenants_file else {})
    try:
        return config.priority_classes(tenants)
    except ValueError as exc:
        raise TenantFileError(f"{config.admission_tenants_file}: {exc}") from exc


def prompt_tokens(spec: PromptSpec) -> int:
    """The prompt's length in tokens before tokenizing: its token ids', else its text's length
    / 4, plus a batch's other prompts (``PromptSpec.rest_tokens``): admission's fair-share
    cost, the rate limits' tokens."""
    first = (len(spec.token_ids) if spec.token_ids is not None
             else estimated_tokens(spec.fallback_text()))
    return first + spec.rest_tokens


class FleetAdmission:
    """Rate limits and the admission gate of one router process (both off by default).

    ``on_load_change`` is where the dispatch record reports a replica's load change: it kicks
    the gate (room for a waiting request, maybe)."""

    def __init__(self, config: RouterConfig, fleet: Fleet, tracker: LoadTracker,
                 learner: PrefillRateLearner, metrics: RouterMetrics, authenticated: bool) -> None:
        self.config = config
        self.fleet = fleet
        self.tracker = tracker
        self.learner = learner
        self.authenticated = authenticated  # API keys on: the tenant names the class's share
        self.classes = traffic_classes(config)
        self.gate = AdmissionGate(
            config.admission_limits(), self._loads, self._event,
            order=FairOrder(config.admission_priority_aging_s, weight_of=self.classes.weight_of))
        self.metrics = AdmissionMetrics(
            metrics.registry, self.gate, self.classes.names,
            per_tenant=bool(config.api_keys) and config.metrics_access == "admin")
        self.rate_limits = TenantRateLimits(
            config.rate_limit_requests_per_min, config.rate_limit_tokens_per_min,
            load_tenant_file(config.admission_tenants_file) if config.admission_tenants_file
            else {}, lambda: redis_client(config.redis_url or "", config.redis_password,
                                          socket_connect_timeout=0.5, socket_timeout=0.5),
            config.redis_prefix, metrics.registry, config.redis_url)

    async def admit(self, parsed: ParsedRequest, request: web.Request) -> AdmissionSlot:
        """Count the request against its tenant's rate limits (429), then wait for room in the
        fleet (``router.traffic.gate``) in the request's priority class and its tenant's share
        (``router.traffic.classes``); raises ``Overloaded`` (503 with Retry-After),
        ``BadRequest`` for an unknown class. The request's cost for fairness is its prefill
        without a hit at the fleet's typical rate, its length the token ids' or estimated from
        the text (4 characters a token: it is tokenized when routed, after the wait)."""
        spec, tenant = parsed.spec, request.get(TENANT_KEY)
        gate = self.gate
        num_tokens = prompt_tokens(spec) if self.rate_limits.enabled or gate.enabled else 1
        await self.rate_limits.check(tenant or "", num_tokens)
        if not gate.enabled:
            self._engine_priority(parsed, request, None)
            return await gate.admit(request[REQUEST_ID_KEY], spec.model)
        rank, work, target_s = self.terms(spec, request, num_tokens)
        cost_s = work * self.learner.estimate("").s_per_token
        slot = await gate.admit(request[REQUEST_ID_KEY], spec.model, cost_s, rank, tenant or "",
                                work, target_s)
        self._engine_priority(parsed, request, slot.priority)
        return slot

    def _engine_priority(self, parsed: ParsedRequest, request: web.Request,
                         rank: int | None) -> None:
        """What reaches the engine as the body's ``priority``. With ``admission_forward_priority``
        the request's class rank (``rank``, or worked out here with the gate off): vLLM's
        priority scheduler (``--scheduling-policy priority``) serves lower values first, as
        ranks go. With API keys on and no forwarding, vLLM's default 0 in place of a client's
        own value, so no tenant jumps the engine's queue (a batch tenant's ``-5`` reached it).
        Otherwise (one trust domain) the body as sent. Raises ``BadRequest`` for an unknown
        class or a priority that is not an integer, as admission does."""
        spec = parsed.spec
        if self.config.admission_forward_priority:
            if rank is None:
                rank = self.classes.request_rank(request.headers.get(PRIORITY_HEADER),
                                                 spec.priority, request.get(TENANT_KEY),
                                                 self.authenticated)
            parsed.body.set("priority", rank)
        elif self.authenticated and spec.priority not in (None, 0):
            parsed.body.set("priority", 0)

    def terms(self, spec: PromptSpec, request: web.Request, num_tokens: int | None = None,
              ) -> tuple[int, float, float | None]:
        """A request's class rank (0 the highest), its own prefill work in tokens without a hit
        (``num_tokens``: its prompt length when already counted) and its TTFT target (seconds;
        None: none, ``router.traffic.classes``). Raises ``BadRequest`` for an unknown class."""
        tenant = request.get(TENANT_KEY)
        rank = self.classes.request_rank(request.headers.get(PRIORITY_HEADER), spec.priority,
                                         tenant, self.authenticated)
        work = prefill_work_tokens(prompt_tokens(spec) if num_tokens is None else num_tokens, 0)
        return rank, work, self.classes.ttft_target_s(rank, tenant)

    def room_check(self) -> Callable[[str], bool] | None:
        """What routing asks of a candidate replica: whether it has room (None: admission off,
        every replica has)."""
        return self.has_room if self.gate.enabled else None

    def has_room(self, replica_id: str) -> bool:
        return self.gate.limits.replica_has_room(self.replica_load(replica_id))

    def replica_load(self, replica_id: str) -> ReplicaLoad:
        """A replica's load for admission: this router's requests in flight there, and the
        prefill tokens of those not yet at their first token at its learned rate (seconds)."""
        rate = self.learner.estimate(replica_id)
        return ReplicaLoad(replica_id, self.tracker.requests(replica_id),
                           self.tracker.prefill_tokens(replica_id) * rate.s_per_token,
                           rate.s_per_token, rate.overhead_s)

    def _loads(self, model: str | None) -> list[ReplicaLoad] | None:
        """The loads of the replicas that could serve ``model`` now; None when routing would
        refuse it (unknown model, no routable replica: answered at once, not queued)."""
        try:
            eligible, _, _ = self.fleet.eligible(model, time.monotonic())
        except RouterError:
            return None
        return [self.replica_load(r.replica_id) for r in eligible]

    def _event(self, event: AdmissionEvent) -> None:
        self.metrics.observe(event)
