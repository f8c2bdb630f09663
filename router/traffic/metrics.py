"""Prometheus series of admission (``router_admission_*``), on the router's registry. Metrics edge.

``AdmissionMetrics(registry, gate, class_names, per_tenant)`` registers them; ``observe(event)``
is the gate's ``on_event``. The queue length and the admitted count are read from the gate at
scrape time. The ``tenant`` label is set only when ``per_tenant`` (with API keys on, only where
a key is needed to read the metrics: one tenant's traffic is not another's to see); else "".
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from router.traffic.gate import AdmissionEvent, AdmissionGate

_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class AdmissionMetrics:
    """The admission series (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry, gate: AdmissionGate,
                 class_names: Sequence[str] = ("",), per_tenant: bool = False) -> None:
        self._class_names = tuple(class_names)
        self._per_tenant = per_tenant
        self.requests = Counter(
            "router_admission_requests_total", "Completions and chat requests at the admission "
            "gate, by outcome (admitted, shed, cancelled: the client left while queued), whether "
            "they waited in the queue, the reason a request was shed (queue_full, "
            "queue_timeout), priority class and tenant",
            ["outcome", "queued", "reason", "priority_class", "tenant"], registry=registry)
        self.wait = Histogram(
            "router_admission_wait_seconds", "Seconds requests waited in the admission queue, "
            "by outcome (admitted, shed, cancelled); requests admitted at once are not observed",
            ["outcome"], buckets=_WAIT_BUCKETS, registry=registry)
        self.slo = Counter(
            "router_admission_slo_requests_total", "Requests with a TTFT target (SLO-aware "
            "admission), by priority class and outcome: meets (admitted within it at once), "
            "waited (held for it, then admitted), unmeetable (its own prefill misses it: the "
            "limits alone decided), shed (it could no longer be met: a 503)",
            ["priority_class", "outcome"], registry=registry)
        self.predicted_ttft = Histogram(
            "router_admission_predicted_ttft_seconds", "Predicted TTFT of requests with a TTFT "
            "target when admitted (best replica with room, no prefix hit counted), by priority "
            "class", ["priority_class"], buckets=_WAIT_BUCKETS, registry=registry)
        queue_length = Gauge(
            "router_admission_queue_length", "Requests waiting in the admission queue",
            registry=registry)
        queue_length.set_function(lambda: len(gate.queue))
        admitted = Gauge(
            "router_admission_inflight_requests", "This router's requests admitted and not "
            "finished (what admission_max_inflight bounds)", registry=registry)
        admitted.set_function(lambda: gate.num_admitted)

    def observe(self, event: AdmissionEvent) -> None:
        names = self._class_names
        cls = names[event.priority] if event.priority < len(names) else str(event.priority)
        self.requests.labels(event.outcome, "1" if event.queued else "0", event.reason, cls,
                             event.tenant if self._per_tenant else "").inc()
        if event.queued:
            self.wait.labels(event.outcome).observe(event.waited_s)
        if event.slo:
            self.slo.labels(cls, event.slo).inc()
        if event.outcome == "admitted" and event.predicted_ttft_s is not None:
            self.predicted_ttft.labels(cls).observe(event.predicted_ttft_s)
