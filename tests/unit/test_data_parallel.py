"""Data-parallel engines, the pure parts: discovering each rank's KV event sockets, deriving
them by vLLM's port offset, one rank's view refusing another rank's batches, a rank's load out
of the engine's one ``/metrics`` page, and the emulator's merged page (no I/O)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.request.routing import Target
from router.shared.contract import DP_RANK_HEADER
from router.shared.kv_event_sources import (
    RankSource,
    offset_sources,
    parse_kv_event_sources,
)
from router.shared.kv_events import BlockStored, KVEventBatch
from worker.emulator.config import ConfigError, replica_endpoint
from worker.emulator.metrics import EnginesExposition, ReplicaMetrics
from worker.event_filter import EventFilter
from worker.heartbeat import parse_metrics
from worker.report import rank_configs
from worker.report_config import load_config

ENGINE = "http://10.0.0.5:8000"


def test_the_sources_shapes_vllm_served_parse_to_the_same_ranks() -> None:
    bare = [{"data_parallel_rank": 1, "endpoint": "tcp://*:5558", "replay_endpoint": None,
             "topic": "kv"},
            {"data_parallel_rank": 0, "endpoint": "tcp://*:5557",
             "replay_endpoint": "tcp://*:5657", "topic": "kv"}]
    keyed = {"0": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                   "replay_endpoint": "tcp://*:5657", "topic": "kv", "hwm": 100000},
             "1": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5558",
                   "topic": "kv"}}
    want = [RankSource(0, "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5657", "kv"),
            RankSource(1, "tcp://10.0.0.5:5558", None, "kv")]
    assert parse_kv_event_sources(bare, ENGINE) == want
    assert parse_kv_event_sources({"sources": bare}, ENGINE) == want
    assert parse_kv_event_sources(keyed, ENGINE) == want
    # a concrete address stays; a rank without events is left out
    assert parse_kv_event_sources(
        {"0": {"endpoint": "tcp://10.1.1.1:7000"}, "1": {"publisher": "null", "endpoint": "x"}},
        ENGINE) == [RankSource(0, "tcp://10.1.1.1:7000")]


@pytest.mark.parametrize("body", [
    "nope", [{"endpoint": "tcp://*:1"}], [{"data_parallel_rank": 0, "endpoint": "5557"}],
    [{"data_parallel_rank": 0, "endpoint": "tcp://*:1"},
     {"data_parallel_rank": 0, "endpoint": "tcp://*:2"}],
    {"-1": {"endpoint": "tcp://*:1"}}, [1]])
def test_malformed_sources_are_refused(body: object) -> None:
    with pytest.raises(ValueError):
        parse_kv_event_sources(body, ENGINE)


def test_configured_ranks_offset_the_port_as_vllm_does() -> None:
    assert offset_sources("tcp://h:5557", "tcp://h:5657", "t", 3) == [
        RankSource(0, "tcp://h:5557", "tcp://h:5657", "t"),
        RankSource(1, "tcp://h:5558", "tcp://h:5658", "t"),
        RankSource(2, "tcp://h:5559", "tcp://h:5659", "t")]
    assert offset_sources("inproc://ev", None, "", 2)[1].endpoint == "inproc://ev_dp1"
    assert offset_sources("tcp://h:0", None, "", 1) == [RankSource(0, "tcp://h:0")]
    with pytest.raises(ValueError):
        offset_sources("tcp://h:0", None, "", 2)  # ephemeral ports: only discovery knows them
    # the emulator binds rank r of replica i where a worker derives it
    assert replica_endpoint("tcp://*:5557", 0, "127.0.0.1", 1, 2).address == "tcp://127.0.0.1:5558"
    assert replica_endpoint("tcp://*:5557", 1, "127.0.0.1", 1, 2).address == "tcp://127.0.0.1:5560"


def test_replica_ids_and_worker_settings() -> None:
    base = ["--engine-url", ENGINE, "--redis-url", "redis://127.0.0.1:6379/0", "--replica-id", "a"]
    assert load_config([*base, "--kv-events-endpoint", "auto"], env={}).kv_events_endpoint == "auto"
    config = load_config([*base, "--kv-events-endpoint", "tcp://h:5557",
                          "--data-parallel-size", "2"], env={})
    assert config.data_parallel_size == 2
    ranks = rank_configs(config, offset_sources("tcp://h:5557", None, "", 2))
    assert [(c.replica_id, c.kv_events_endpoint) for c in ranks] == [
        ("a#0", "tcp://h:5557"), ("a#1", "tcp://h:5558")]
    single = rank_configs(config, [RankSource(0, "tcp://h:5557")])
    assert [c.replica_id for c in single] == ["a"]  # no data parallelism: the id as given
    assert [c.replica_id for c in rank_configs(config, [RankSource(1, "tcp://h:5558")])] == ["a#1"]
    for bad in (["--kv-events-endpoint", "tcp://h:0", "--data-parallel-size", "2"],
                ["--kv-events-endpoint", "tcp://h:5557", "--data-parallel-size", "0"],
                ["--kv-events-endpoint", "automatic"]):
        with pytest.raises(ConfigError):
            load_config([*base, *bad], env={})


def _stored(block_hash: int) -> BlockStored:
    return BlockStored(block_hashes=[block_hash], parent_block_hash=None,
                       token_ids=list(range(16)), block_size=16, lora_id=None, medium="GPU",
                       lora_name=None)


def test_a_ranks_view_skips_another_ranks_batches_with_a_counter() -> None:
    rank_0 = EventFilter(dp_rank=0)
    assert rank_0.apply(KVEventBatch(1.0, [_stored(1)], 1)).events == []
    assert rank_0.apply(KVEventBatch(1.0, [_stored(2)], 0)).events == [_stored(2)]
    assert rank_0.apply(KVEventBatch(1.0, [_stored(3)], None)).events == [_stored(3)]
    assert dict(rank_0.skipped_by_reason())["dp_rank"] == 1
    # a view of an engine without data parallelism takes every batch
    assert EventFilter().apply(KVEventBatch(1.0, [_stored(4)], 3)).events == [_stored(4)]


def _engine_metrics(rank: int, running: int) -> ReplicaMetrics:
    metrics = ReplicaMetrics("m", {"block_size": "16", "engine": str(rank)},
                             lambda: running, lambda: 2 * running, lambda: 0.1 * (rank + 1))
    metrics.prefix_cache_queries.inc(100 * (rank + 1))
    return metrics


def test_one_page_for_two_ranks_and_each_ranks_load_read_back() -> None:
    page = EnginesExposition([_engine_metrics(0, 3), _engine_metrics(1, 5)]).exposition().decode()
    # one HELP/TYPE per family (a valid page), both ranks' series under it
    assert page.count("# TYPE vllm:num_requests_running gauge") == 1
    families = {f.name: f for f in text_string_to_metric_families(page)}
    ranks = {s.labels["engine"] for s in families["vllm:num_requests_running"].samples}
    assert ranks == {"0", "1"}
    rank_1 = parse_metrics(page, "1")
    assert (rank_1.num_running, rank_1.num_waiting, rank_1.prefix_cache_queries) == (5, 10, 200)
    assert rank_1.kv_usage == pytest.approx(0.2)
    assert rank_1.block_size == 16
    assert parse_metrics(page).num_running == 8  # the engine as a whole


def test_a_targets_rank_is_the_header_vllm_reads() -> None:
    from multidict import CIMultiDict

    from router.edges.proxy import target_headers

    shared: CIMultiDict[str] = CIMultiDict({"x-request-id": "r1"})
    ranked = target_headers(shared, Target("e#1", "http://e:8000", dp_rank=1))
    assert ranked[DP_RANK_HEADER] == "1"
    assert DP_RANK_HEADER not in shared  # the attempts of one request share the client's headers
    assert target_headers(shared, Target("e", "http://e:8000")) is shared


def test_a_replicas_target_series_follows_its_url_and_rank() -> None:
    from router.observability.metrics import RouterMetrics

    metrics = RouterMetrics()
    metrics.set_replica_target("e#1", "http://a:1", 1)
    metrics.set_replica_target("e#1", "http://b:1", 1)  # the engine moved
    page = metrics.render().decode()
    assert 'router_replica_info{dp_rank="1",replica="e#1",url="http://b:1"} 1.0' in page
    assert "http://a:1" not in page
    metrics.forget_replica("e#1")
    assert "router_replica_info{" not in metrics.render().decode()


def test_a_ranks_heartbeat_makes_a_target_and_survives_the_fleet_cache() -> None:
    import time

    from router.shared import contract as c
    from tests.unit.router_service import MODEL, service_with_replicas

    service = service_with_replicas(0)
    now = time.time()
    for rank in (0, 1):
        service.fleet.apply_heartbeat(f"e#{rank}", {
            c.F_URL: "http://127.0.0.1:9000/", c.F_DP_RANK: str(rank),
            c.F_MODELS: f'["{MODEL}"]', c.F_HEARTBEAT_TS: str(now)}, now)
    service.fleet.apply_heartbeat("plain", {c.F_URL: "http://127.0.0.1:9001",
                                            c.F_DP_RANK: "", c.F_HEARTBEAT_TS: str(now)}, now)
    fleet = service.fleet
    assert [(r.url, r.dp_rank) for r in map(fleet.replicas.get, ("e#0", "e#1", "plain"))] == [
        ("http://127.0.0.1:9000", 0), ("http://127.0.0.1:9000", 1), ("http://127.0.0.1:9001", None)]
    _, targets = service.router.least_loaded(MODEL)
    assert targets and all(t.dp_rank == {"e#0": 0, "e#1": 1, "plain": None}[t.replica_id]
                           for t in targets)
    restarted = service_with_replicas(0).fleet
    assert restarted.add_fallbacks(fleet.fleet_snapshot(), ()) == 3
    assert restarted.replicas["e#1"].dp_rank == 1
    assert restarted.replicas["plain"].dp_rank is None
