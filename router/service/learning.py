"""What the router learns from a finished request: first-byte rates for the first-byte deadlines
and the ttft policy, TTFT and hit metrics, the typical output length, and the template audit's
observation. No I/O (metrics are in-process; the audit runs after the answer, ``audit_queue``).
"""

from __future__ import annotations

from typing import Final

from router.decision.load import LoadTracker
from router.decision.policy import Decision, TtftPrediction
from router.decision.ttft import PrefillRateLearner
from router.edges.proxy import ProxyOutcome
from router.observability.metrics import RouterMetrics
from router.request.dispatch import Dispatch, Dispatcher
from router.request.prompts import PromptSpec
from router.request.routing import Routed
from router.request.usage import cached_tokens_from_sse_tail, completion_tokens_from_tail
from router.service.audit_queue import AuditQueue

# router_ttft_seconds' model label of a LoRA request where adapters are not named (see below)
ADAPTER_LABEL: Final = "lora-adapter"


class RequestLearning:
    """Learning from answered requests (``observe``), after the answer was relayed.
    ``name_adapters`` False (API keys on and ``/metrics`` open): a LoRA request's TTFT is
    labelled ``ADAPTER_LABEL``, not the adapter's name: with an adapter per tenant, its series
    would tell anyone without a key when that tenant sends requests."""

    def __init__(self, block_size: int, metrics: RouterMetrics, dispatcher: Dispatcher,
                 tracker: LoadTracker, learner: PrefillRateLearner, audit: AuditQueue,
                 name_adapters: bool = True) -> None:
        self.block_size = block_size  # tokens
        self.name_adapters = name_adapters
        self.metrics = metrics
        self.dispatcher = dispatcher
        self.tracker = tracker
        self.learner = learner
        self.audit = audit

    def observe(self, spec: PromptSpec, routed: Routed, dispatch: Dispatch,
                outcome: ProxyOutcome, arrival: float, tenant: str | None) -> None:
        """What an answered request teaches: first-byte rates, TTFT metrics, hit counters and
        the template audit. ``arrival``: ``time.perf_counter()`` when the request came in."""
        decision, replica_id, status = routed.decision, outcome.replica_id, outcome.status
        if outcome.first_byte_s is not None and status == 200:
            since_send_s = arrival + outcome.first_byte_s - dispatch.sent_at(replica_id)
            if not spec.stream:  # its first byte is the whole answer: not a TTFT
                dispatch.observe_answer(replica_id, since_send_s)
            else:
                self.dispatcher.observe_first_byte(replica_id, outcome.first_byte_s,
                                                   dispatch.prefill_tokens)
                model = spec.model or ""
                if routed.lora is not None and not self.name_adapters:
                    model = ADAPTER_LABEL
                self._observe_ttft(model, decision, outcome)
                self._observe_first_token(dispatch.prediction(replica_id), replica_id,
                                          since_send_s)
        hit_tokens = decision.hit_blocks * self.block_size
        predicted_hit = hit_tokens if replica_id == decision.replica_id else 0
        metrics = self.metrics
        metrics.child(metrics.prompt_tokens, replica_id).inc(routed.num_tokens)
        metrics.child(metrics.predicted_hit_tokens, replica_id).inc(predicted_hit)
        if replica_id == decision.replica_id and decision.predicted_hit:  # per tier
            hit = decision.hit(replica_id)
            metrics.child(metrics.predicted_tier_hit_blocks, replica_id, "GPU").inc(hit.blocks)
            metrics.child(metrics.predicted_tier_hit_blocks, replica_id,
                          "CPU").inc(hit.cpu_blocks)
        if status == 200:
            generated = completion_tokens_from_tail(outcome.tail)
            if generated is not None:  # the decode term's typical output length (ttft policy)
                self.tracker.observe_output(generated)
            self.audit.submit(spec, routed.num_tokens, predicted_hit, outcome.tail, tenant)

    def _observe_ttft(self, model: str, decision: Decision, outcome: ProxyOutcome) -> None:
        """``router_ttft_seconds`` of a streamed answer for ``model`` (its label), split by the
        engine's own cached_tokens when its last event reported usage, else by the router's
        prediction."""
        cached = cached_tokens_from_sse_tail(outcome.tail)
        if cached is not None:
            cache, source = ("hit" if cached > 0 else "miss"), "engine"
        else:
            cache, source = ("hit" if decision.predicted_hit else "miss"), "predicted"
        assert outcome.first_byte_s is not None
        self.metrics.child(self.metrics.ttft, model, cache, source).observe(
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
