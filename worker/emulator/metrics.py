"""Prometheus metrics of one emulated replica, with vLLM 0.33's names and labels. Does I/O (exposition).

Names, labels and buckets copy ``vllm/v1/metrics/loggers.py``: every series has
``model_name`` (first served model name) and ``engine="<DP rank>"`` (``"0"`` without data
parallelism); counters gain the ``_total`` suffix. Each replica has its own ``CollectorRegistry`` so K replicas
in one process expose only their own figures. Gauges read the scheduler when
scraped (no per-step cost). Times are engine seconds (wall time multiplied by
``--time-scale``), so dashboards show what the emulated GPU would show.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from worker.emulator.offload import OffloadStats

TTFT_BUCKETS_S: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # vLLM 0.33 vllm:time_to_first_token_seconds buckets
LAG_BUCKETS_S: Final = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)  # emulator only: wall seconds a step started behind the engine's own clock
LATE_STEP_S: Final = 0.001  # a step that starts more than this behind schedule counts as late
REQUEST_LATENCY_BUCKETS_S: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # vLLM 0.33 request latency buckets (e2e, queue)


class ReplicaMetrics:
    """The ``vllm:*`` series of one replica. ``gauges`` callbacks are read at scrape time."""

    def __init__(
        self,
        model_name: str,
        cache_config: dict[str, str],
        num_running: Callable[[], float],
        num_waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._text = TextExposition()
        # vLLM loggers.py: one series per engine, labelled with its DP rank
        labels = {"model_name": model_name, "engine": cache_config.get("engine", "0")}
        names = ["model_name", "engine"]
        reg = self.registry
        self._labels = labels

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg)

        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        ).labels(**labels)
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        ).labels(**labels)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(**labels)
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        ).labels(**labels)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        ).labels(**labels)
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        ).labels(**labels)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=reg)
        self.request_success = {
            reason: success.labels(finished_reason=reason, **labels)
            for reason in ("stop", "length", "abort")
        }
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            names, buckets=TTFT_BUCKETS_S, registry=reg,
        ).labels(**labels)
        self.e2e_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            names, buckets=REQUEST_LATENCY_BUCKETS_S, registry=reg,
        ).labels(**labels)
        Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              names, registry=reg).labels(**labels).set_function(num_running)
        Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              names, registry=reg).labels(**labels).set_function(num_waiting)
        Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              names, registry=reg).labels(**labels).set_function(kv_usage)
        # Emulator only (no vLLM counterpart): how far the engine runs behind its own clock
        # because the host did not let the process run; wall seconds, per step.
        self.engine_lag = Histogram(
            "emulator_engine_lag_seconds",
            "Wall seconds each engine step started behind the engine's own schedule.",
            names, buckets=LAG_BUCKETS_S, registry=reg,
        ).labels(**labels)
        self.engine_late_steps = counter(
            "emulator_engine_late_steps",
            f"Engine steps that started more than {LATE_STEP_S * 1000:g} ms behind schedule.",
        ).labels(**labels)
        self.engine_lag_max = Gauge(
            "emulator_engine_lag_max_seconds",
            "Largest lag of any engine step since the replica started (wall seconds).",
            names, registry=reg,
        ).labels(**labels)
        self._lag_max = 0.0
        self.offload: OffloadMetrics | None = None
        info_labels = sorted(cache_config)
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
              info_labels, registry=reg).labels(**cache_config).set(1)

    def enable_lora_info(self, max_lora: int,
                         adapters: Callable[[], tuple[list[str], list[str]]]) -> None:
        """Export ``vllm:lora_requests_info`` (vLLM exports it when LoRA is on):
        ``adapters()`` gives the adapter names of the running and the waiting requests."""
        self.registry.register(LoraInfo(max_lora, adapters))

    def observe_lag(self, lag_s: float) -> None:
        """Record one engine step's start lag in wall seconds (negative: on time, counts 0)."""
        lag_s = max(lag_s, 0.0)
        self.engine_lag.observe(lag_s)
        if lag_s > LATE_STEP_S:
            self.engine_late_steps.inc()
        if lag_s > self._lag_max:
            self._lag_max = lag_s
            self.engine_lag_max.set(lag_s)

    def enable_offload(self, cpu_usage: Callable[[], float]) -> OffloadMetrics:
        """Add the CPU tier's series (only replicas with ``--kv-offloading-size`` have them)."""
        self.offload = OffloadMetrics(self.registry, self._labels, cpu_usage)
        return self.offload

    def exposition(self) -> bytes:
        """The text exposition format (``/metrics`` body), byte for byte what
        ``prometheus_client.generate_latest`` gives (``TextExposition``)."""
        return self._text.render(self.registry)



class LoraInfo(Collector):
    """``vllm:lora_requests_info`` read at scrape time: one series labelled ``max_lora``,
    ``waiting_lora_adapters`` and ``running_lora_adapters`` (names joined by ","), valued the
    current unix time. vLLM 0.32 (``v1/metrics/loggers.py``) sets a new label set's series to
    the time at each stats update and leaves the earlier series on the page; the emulator shows
    only the current one (readers take the newest, ``router.apis.lora_load``). No ``engine``
    or ``model_name`` label, as in vLLM."""

    def __init__(self, max_lora: int, adapters: Callable[[], tuple[list[str], list[str]]]) -> None:
        self.max_lora = max_lora
        self.adapters = adapters

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "waiting_lora_adapters",
                                         "running_lora_adapters"])

    def describe(self) -> Iterator[Metric]:
        """The family without samples (the registry asks at registration, before the engine
        has its queues)."""
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        running, waiting = self.adapters()
        family = self._family()
        family.add_metric([str(self.max_lora), ",".join(waiting), ",".join(running)], time.time())
        yield family


_OM_SUFFIXES: Final = ("_created", "_gsum", "_gcount")
_TYPES: Final = {"counter": "counter", "info": "gauge", "stateset": "gauge",
                 "gaugehistogram": "histogram", "unknown": "untyped"}
_ESCAPING: Final = openmetrics.UNDERSCORES  # generate_latest's default


def _escape_label_value(value: str) -> str:
    """Label values allow UTF-8; backslash, newline and double quote are escaped (the library's
    ``_escape`` with ``ALLOWUTF8``)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


class _EngineFamilies(Collector):
    """The families of several engines' registries merged by name (one ``# HELP``/``# TYPE``
    per family, the engines' series in rank order), as vLLM's one ``/metrics`` page shows the
    series of every DP rank under their ``engine`` label."""

    def __init__(self, registries: list[CollectorRegistry]) -> None:
        self.registries = registries

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for registry in self.registries:
            for family in registry.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation,
                                                        family.type)
                into.samples.extend(family.samples)
        yield from merged.values()


class EnginesExposition:
    """``/metrics`` of one API server fronting ``engines`` (DP ranks): their families merged."""

    def __init__(self, engines: list[ReplicaMetrics]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineFamilies([m.registry for m in engines]))
        self._text = TextExposition()
        self._single = engines[0] if len(engines) == 1 else None

    def exposition(self) -> bytes:
        if self._single is not None:  # one engine: its own page, nothing to merge
            return self._single.exposition()
        return self._text.render(self.registry)


class TextExposition:
    """``prometheus_client.generate_latest``'s text format with the escaped names and label
    sets of each series worked out once and kept: the library escapes and validates every
    label of every sample on every scrape, a millisecond per replica page, and the workers and
    the benchmark scrape every replica every second. Same algorithm and escaping functions as
    prometheus_client 0.26 ``generate_latest``; ``tests/unit/test_emulator_metrics.py`` holds
    the two to the same bytes."""

    def __init__(self) -> None:
        self._heads: dict[tuple[str, str, str, str], str] = {}
        self._series: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}

    def _head(self, name: str, mtype: str, doc: str, suffix: str = "") -> str:
        key = (name, mtype, doc, suffix)
        head = self._heads.get(key)
        if head is None:
            if suffix:
                shown, shown_type = name + suffix, "gauge"
            else:
                shown = name + ("_total" if mtype == "counter" else "_info" if mtype == "info"
                                else "")
                shown_type = _TYPES.get(mtype, mtype)
            escaped = openmetrics.escape_metric_name(shown, _ESCAPING)
            doc_text = doc.replace("\\", r"\\").replace("\n", r"\n")
            head = f"# HELP {escaped} {doc_text}\n# TYPE {escaped} {shown_type}\n"
            self._heads[key] = head
        return head

    def _prefix(self, name: str, labels: dict[str, str]) -> str:
        key = (name, tuple(labels.items()))
        prefix = self._series.get(key)
        if prefix is None:
            labelstr = ",".join(
                f'{openmetrics.escape_label_name(k, _ESCAPING)}="{_escape_label_value(v)}"'
                for k, v in sorted(labels.items()))
            prefix = openmetrics.escape_metric_name(name, _ESCAPING) + (
                "{" + labelstr + "}" if labelstr else "") + " "
            self._series[key] = prefix
        return prefix

    def render(self, registry: CollectorRegistry) -> bytes:
        out: list[str] = []
        for metric in registry.collect():
            out.append(self._head(metric.name, metric.type, metric.documentation))
            extra: dict[str, list[str]] = {}
            for sample in metric.samples:
                line = self._prefix(sample.name, sample.labels) + floatToGoString(sample.value)
                if sample.timestamp is not None:
                    line += f" {int(float(sample.timestamp) * 1000):d}"
                line += "\n"
                for suffix in _OM_SUFFIXES:
                    if sample.name == metric.name + suffix:
                        extra.setdefault(suffix, []).append(line)
                        break
                else:
                    out.append(line)
            for suffix, lines in sorted(extra.items()):
                out.append(self._head(metric.name, metric.type, metric.documentation, suffix))
                out.extend(lines)
        return "".join(out).encode("utf-8")


class OffloadMetrics:
    """The CPU tier's series, with vLLM's names: ``vllm:external_prefix_cache_{queries,hits}``
    (tokens looked up beyond the GPU hit and found in the tier, scheduler
    ``connector_prefix_cache_stats``), ``vllm:kv_offload_total_bytes`` and
    ``vllm:kv_offload_total_time`` (seconds) by ``transfer_type`` ``GPU_to_CPU`` /
    ``CPU_to_GPU`` (offloading connector metrics); plus the emulator-only gauge
    ``emulator_cpu_kv_cache_usage_perc`` (host blocks holding a hash, 0..1: vLLM's own
    CPU-usage gauge counts in-flight transfers, not residency)."""

    def __init__(self, reg: CollectorRegistry, labels: dict[str, str],
                 cpu_usage: Callable[[], float]) -> None:
        names = list(labels)
        self.external_queries = Counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, "
            "in terms of number of queried tokens.", names, registry=reg).labels(**labels)
        self.external_hits = Counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, "
            "in terms of number of cached tokens.", names, registry=reg).labels(**labels)
        kind = [*names, "transfer_type"]
        total_bytes = Counter("vllm:kv_offload_total_bytes", "Number of bytes offloaded by KV connector",
                              kind, registry=reg)
        total_time = Counter("vllm:kv_offload_total_time", "Total time measured by all KV offloading",
                             kind, registry=reg)
        self.store_bytes = total_bytes.labels(transfer_type="GPU_to_CPU", **labels)
        self.load_bytes = total_bytes.labels(transfer_type="CPU_to_GPU", **labels)
        self.store_time = total_time.labels(transfer_type="GPU_to_CPU", **labels)
        self.load_time = total_time.labels(transfer_type="CPU_to_GPU", **labels)
        Gauge("emulator_cpu_kv_cache_usage_perc",
              "Fraction of the CPU tier's blocks holding a block hash. 1 means full.",
              names, registry=reg).labels(**labels).set_function(cpu_usage)
        self._last = (0, 0, 0, 0.0, 0, 0.0)

    def sync(self, stats: OffloadStats) -> None:
        """Add what ``stats`` (cumulative) gained since the last call."""
        now = (stats.external_queries, stats.external_hits, stats.store_bytes, stats.store_s,
               stats.load_bytes, stats.load_s)
        if now == self._last:
            return
        last = self._last
        for series, new, old in zip(
                (self.external_queries, self.external_hits, self.store_bytes, self.store_time,
                 self.load_bytes, self.load_time), now, last, strict=True):
            if new != old:
                series.inc(new - old)
        self._last = now
