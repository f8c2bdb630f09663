"""Prometheus metrics of the router (``router_*``), on a registry per app. Metrics edge.

One ``RouterMetrics`` per running app so several routers can live in one test
process. ``render()`` returns the text exposition for ``GET /metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                 20.0, 40.0, 80.0)  # vLLM's TTFT buckets, trimmed
_ERROR_BUCKETS = (-5.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, -0.005, 0.0, 0.005, 0.01,
                  0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)  # seconds, signed: late > 0, early < 0


class RouterMetrics:
    """All router metrics. Label values: replica ids, decision reasons, HTTP status codes."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}  # {(metric id, labels): child}
        self.requests = Counter(
            "router_requests_total", "Requests finished, by chosen replica, decision reason, "
            "endpoint and final HTTP status", ["replica", "reason", "endpoint", "status"],
            registry=registry)
        self.prompt_tokens = Counter(
            "router_prompt_tokens_total", "Prompt tokens of routed requests", ["replica"],
            registry=registry)
        self.predicted_hit_tokens = Counter(
            "router_predicted_hit_tokens_total", "Prompt tokens predicted to hit the chosen "
            "replica's prefix cache (GPU tier)", ["replica"], registry=registry)
        self.predicted_tier_hit_blocks = Counter(
            "router_predicted_hit_blocks_total", "Prompt blocks predicted to hit the chosen "
            "replica, per tier: GPU (its own pool) or CPU (host memory, loaded instead of "
            "recomputed)", ["replica", "tier"], registry=registry)
        self.ttft = Histogram(
            "router_ttft_seconds", "Streamed requests: time from request arrival to the first "
            "response byte from the replica, per model, split by prefix-cache hit (cache=hit: "
            "cached_tokens > 0) as the engine reported it in usage.prompt_tokens_details "
            "(source=engine) or, when it did not, as the router predicted it (source=predicted)",
            ["model", "cache", "source"], buckets=_TTFT_BUCKETS, registry=registry)
        self.ttft_prediction_error = Histogram(
            "router_ttft_prediction_error_seconds", "Observed minus predicted time from dispatch "
            "to first token of streamed requests, per replica (the ttft policy's prediction, or "
            "the same model's under other policies): how well the learned prefill model fits "
            "the fleet", ["replica"], buckets=_ERROR_BUCKETS,
            registry=registry)
        self.overhead = Histogram(
            "router_overhead_seconds", "Router time from request arrival to upstream send "
            "(parse, tokenize, hash, route)", ["endpoint"], buckets=_LATENCY_BUCKETS,
            registry=registry)
        self.tokenize = Histogram(
            "router_tokenize_seconds", "Time to compute a prompt's length and block-key chain "
            "(tokenize + hash through the chain cache); path=inline on the event loop (cached or "
            "small), path=sliced on the event loop between its turns (long token ids), "
            "path=thread in the tokenizer thread pool", ["kind", "path"],
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.inflight = Gauge(
            "router_inflight_requests", "Requests this router has in flight per replica",
            ["replica"], registry=registry)
        self.inflight_prefill = Gauge(
            "router_inflight_prefill_tokens", "Prefill tokens this router has sent that have not "
            "produced a first byte yet, per replica", ["replica"], registry=registry)
        self.untokenized = Counter(
            "router_untokenized_requests_total", "Requests routed without exact prompt tokens "
            "(consistent hashing on the text)", ["cause"], registry=registry)
        self.retries = Counter(
            "router_upstream_retries_total", "Upstream attempts retried before the first byte",
            ["cause"], registry=registry)
        self.upstream_errors = Counter(
            "router_upstream_errors_total", "Upstream failures, by replica and kind",
            ["replica", "kind"], registry=registry)
        self.loop_late = Counter(
            "router_loop_late_verdicts_total", "Timeouts not counted against a replica because "
            "the router's own event loop ran late over their span (router.observability.loop_lag), by kind",
            ["kind"], registry=registry)
        self.circuit_probes = Counter(
            "router_circuit_probes_total", "Router-made 1-token completions sent to replicas "
            "whose circuit is half-open, by replica and result (ok, failed, router_late)",
            ["replica", "result"], registry=registry)
        self.index_blocks = Gauge(
            "router_index_blocks", "Distinct block keys in the router's index", registry=registry)
        self.prompt_cache_bytes = Gauge(
            "router_prompt_cache_bytes", "Estimated memory held by a prompt cache (bounded by "
            "prompt_cache_mib): chain (block-key chains), chunk_tokens, rendered_chat",
            ["cache"], registry=registry)
        self.prompt_cache_entries = Gauge(
            "router_prompt_cache_entries", "Entries held by a prompt cache", ["cache"],
            registry=registry)
        self.replica_blocks = Gauge(
            "router_index_replica_blocks", "Block keys the index holds per replica (GPU tier)",
            ["replica"], registry=registry)
        self.replica_cpu_blocks = Gauge(
            "router_index_replica_cpu_blocks", "Block keys the index holds per replica in its CPU "
            "tier (host memory, vLLM native KV offloading)", ["replica"], registry=registry)
        self.speculative_blocks = Gauge(
            "router_speculative_blocks", "Block keys in the speculative placement table",
            registry=registry)
        self.event_lag = Gauge(
            "router_event_lag_seconds", "Age of the last KV change-stream entry applied "
            "(now - entry id time)", registry=registry)
        self.events = Counter(
            "router_events_total", "KV change-stream entries applied, by op", ["op"],
            registry=registry)
        self.event_errors = Counter(
            "router_event_errors_total", "Malformed or stale stream entries dropped", ["cause"],
            registry=registry)
        self.redis_connected = Gauge(
            "router_redis_connected", "1 when the fleet reader is connected to Redis",
            registry=registry)
        self.redis_oom = Gauge(
            "router_redis_oom", "1 while Redis refuses writes for lack of memory (maxmemory "
            "reached under noeviction): reported by a worker or met by this router's reads; "
            "the index lags the replicas until it ends", registry=registry)
        self.stream_gaps = Counter(
            "router_event_stream_gaps_total", "Times stream entries were lost to this router: "
            "the stream trimmed past its read position (a full resync follows) or a replica's "
            "entry_seq skipped (that replica's set is reloaded)", registry=registry)
        self.redis_resyncs = Counter(
            "router_redis_resyncs_total", "Full reloads of heartbeats and block sets",
            registry=registry)
        self.redis_cluster_failovers = Counter(
            "router_redis_cluster_failovers_total", "Times the Redis Cluster's masters changed "
            "between two heartbeat refreshes (a failover): replicas whose heartbeat is missing "
            "then stay one heartbeat TTL for their workers to re-register", registry=registry)
        self.replica_routable = Gauge(
            "router_replica_routable", "1 when a replica takes traffic", ["replica"],
            registry=registry)
        self.fleet_panic = Gauge(
            "router_fleet_panic", "1 while fewer than panic_threshold of the replicas are "
            "routable: the router routes as if all were healthy (Envoy's panic mode)",
            registry=registry)
        self.panic_requests = Counter(
            "router_panic_routed_requests_total", "Requests routed in panic mode (fewer than "
            "panic_threshold of the model's replicas routable)", registry=registry)
        self.replica_affinity = Gauge(
            "router_replica_affinity", "1 when a replica gets prefix-hit credit (hash verified, "
            "same block size and hash settings)", ["replica"], registry=registry)
        self.replica_info = Gauge(
            "router_replica_info", "1 per replica: the URL its requests go to and the engine's "
            "data-parallel rank they select (dp_rank \"\" without data parallelism)",
            ["replica", "url", "dp_rank"], registry=registry)
        self._replica_targets: dict[str, tuple[str, str, str]] = {}  # {replica: info labels}
        self.replica_config_mismatch = Gauge(
            "router_replica_config_mismatch", "1 when a replica's worker uses another Redis "
            "contract version, index_stride, block size, hash algorithm or hash seed than this "
            "router (no prefix-hit credit; no traffic while a replica without one serves the "
            "model)",
            ["replica"], registry=registry)

    def watch_audit(self, audit: Any, top_k: int, per_family: bool = True) -> None:
        """Export the template audit (``router.observability.audit.PrefixAudit``): per-family gauges for the
        ``top_k`` families by traffic only (bounded cardinality: at most ``top_k`` label values,
        each an 8-hex family id that ``GET /debug/prefixes`` explains), and its totals.
        ``per_family`` False: the totals only (tenants' families are not for an open
        ``/metrics``)."""
        self.registry.register(_AuditCollector(audit, top_k if per_family else 0))

    def watch_prompt_caches(self, caches: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        """Export ``router_prompt_cache_lookups_total{cache,result}`` at scrape time from
        ``caches()``: ``(name, cache)`` pairs whose ``hits`` and ``misses`` count lookups
        (``router.request.lru.SizedLRU``, ``router.request.chain_cache.ChainCache``)."""
        self.registry.register(_PromptCacheCollector(caches))

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, memoised: the request path calls this several times per
        request and prometheus_client's ``labels`` takes a lock and validates every call."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def set_replica_target(self, replica_id: str, url: str, dp_rank: int | None) -> None:
        """``router_replica_info`` of one replica: the URL and DP rank its requests go to (a
        changed URL or rank replaces the replica's old series instead of adding one)."""
        labels = (replica_id, url, "" if dp_rank is None else str(dp_rank))
        previous = self._replica_targets.get(replica_id)
        if previous == labels:
            return
        if previous is not None:
            self.replica_info.remove(*previous)
        self._replica_targets[replica_id] = labels
        self.replica_info.labels(*labels).set(1)

    def forget_replica(self, replica_id: str) -> int:
        """Remove every series labelled ``replica=replica_id`` (the replica left the fleet: its
        gauges would otherwise report it forever). Returns how many series were removed."""
        removed = 0
        for metric in {id(m): m for m in vars(self).values()
                       if "replica" in getattr(m, "_labelnames", ())}.values():
            names = metric._labelnames
            combos = {tuple(sample.labels[n] for n in names)
                      for family in metric.collect() for sample in family.samples
                      if sample.labels.get("replica") == replica_id}
            for values in combos:
                metric.remove(*values)
                self._replica_targets.pop(replica_id, None)
                self._children.pop((id(metric), values), None)
                removed += 1
        return removed

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _AuditCollector(Collector):
    """``router_prefix_*`` from a ``PrefixAudit`` at scrape time."""

    def __init__(self, audit: Any, top_k: int) -> None:
        self.audit = audit
        self.top_k = top_k

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only

    def collect(self) -> Any:
        report = self.audit.report(self.top_k)
        if self.top_k:  # 0: no per-family series at all
            yield from self._families(report)
        total = CounterMetricFamily("router_prefix_near_miss_requests", "Requests the template "
                                    "audit found to be near misses of a prefix family")
        total.add_metric([], report["near_miss_requests"])
        yield total
        dropped = CounterMetricFamily("router_prefix_audit_dropped_requests", "Requests the "
                                      "template audit skipped because its queue was full")
        dropped.add_metric([], report["dropped_requests"])
        yield dropped

    def _families(self, report: dict[str, Any]) -> Any:
        requests = GaugeMetricFamily(
            "router_prefix_family_requests", "Requests of a prefix family (top K by traffic; "
            "GET /debug/prefixes names them)", labels=["family"])
        hit_rate = GaugeMetricFamily(
            "router_prefix_family_hit_ratio", "Token prefix-cache hit rate of a prefix family, "
            "from the engine's cached_tokens where reported (source=engine), else predicted",
            labels=["family", "source"])
        near_miss = GaugeMetricFamily(
            "router_prefix_family_near_miss_requests", "Requests of a prefix family that differ "
            "from it inside their first blocks and share a long span after (no prefix hit)",
            labels=["family"])
        for row in report["families"]:
            requests.add_metric([row["family"]], row["requests"])
            hit_rate.add_metric([row["family"], row["hit_rate_source"]], row["hit_rate"])
            near_miss.add_metric([row["family"]], row["near_miss_requests"])
        yield requests
        yield hit_rate
        yield near_miss


class _PromptCacheCollector(Collector):
    """``router_prompt_cache_lookups_total`` from the prompt caches' own counters."""

    def __init__(self, caches: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self.caches = caches

    def describe(self) -> list[Any]:
        return []  # collected at scrape time only

    def collect(self) -> Any:
        lookups = CounterMetricFamily(
            "router_prompt_cache_lookups_total", "Lookups in a prompt cache (chain, chunk_tokens, "
            "rendered_chat) by result (hit, miss); each cache is partitioned by cache_salt (the "
            "tenant's with API keys on), so one tenant's entries never serve another",
            labels=["cache", "result"])
        for name, cache in self.caches():
            lookups.add_metric([name, "hit"], cache.hits)
            lookups.add_metric([name, "miss"], cache.misses)
        yield lookups
