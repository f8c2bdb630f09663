"""The emulator's replica metrics: its text exposition is byte for byte prometheus_client's
(including escaping, ``_created`` series and label order), and the engine lag metrics count."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from worker.emulator.metrics import LATE_STEP_S, ReplicaMetrics, TextExposition


def _replica_metrics() -> ReplicaMetrics:
    return ReplicaMetrics("emulated-llm", {"block_size": "16", "num_gpu_blocks": "32000",
                                           "prefix_caching_hash_algo": "sha256"},
                          lambda: 3, lambda: 1, lambda: 0.25)


def test_replica_page_is_what_prometheus_client_renders() -> None:
    m = _replica_metrics()
    for i in range(50):
        m.ttft.observe(i / 7)
        m.e2e_latency.observe(i / 3)
        m.observe_lag(i / 1000)
    m.request_success["length"].inc(3)
    m.prefix_cache_queries.inc(1024)
    for _ in range(2):  # the second render comes from the kept names
        assert m.exposition() == generate_latest(m.registry)


def test_escaping_and_odd_names_match_the_library() -> None:
    reg = CollectorRegistry()
    Counter("odd:requests", 'help with \\ backslash\nand newline', ["b", "a"],
            registry=reg).labels(b='quote " and \\ and\nnewline', a="é").inc(2.5)
    Gauge("plain", "no labels", registry=reg).set(float("inf"))
    Histogram("lat", "h", buckets=(0.1, 1.0), registry=reg).observe(0.5)
    text = TextExposition()
    assert text.render(reg) == generate_latest(reg)
    assert text.render(reg) == generate_latest(reg)


def test_lag_metrics_count_late_steps_and_keep_the_max() -> None:
    m = _replica_metrics()
    for lag in (-0.001, 0.0, LATE_STEP_S / 2, 0.05, 2.0, 0.01):
        m.observe_lag(lag)
    page = m.exposition().decode()
    assert 'emulator_engine_late_steps_total{engine="0",model_name="emulated-llm"} 3.0' in page
    assert 'emulator_engine_lag_max_seconds{engine="0",model_name="emulated-llm"} 2.0' in page
    assert 'emulator_engine_lag_seconds_count{engine="0",model_name="emulated-llm"} 6.0' in page
