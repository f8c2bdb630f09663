"""Pure pieces of the worker: /metrics and /v1/models parsing, config precedence, probe judging."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from router.shared.hashing import BlockHasher
from router.shared.kv_events import BlockStored
from worker.heartbeat import heartbeat_fields, parse_metrics, parse_models
from worker.probe import ProbeCatcher, judge, probe_tokens
from worker.report_config import ConfigError, load_config

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 400.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="2048",prefix_caching_hash_algo="xxhash"} 1.0
"""


def test_parse_metrics() -> None:
    load = parse_metrics(METRICS)
    assert (load.num_running, load.num_waiting, load.kv_usage) == (3.0, 2.0, 0.25)
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (1000.0, 400.0)
    assert (load.block_size, load.hash_algo, load.num_gpu_blocks) == (32, "xxhash", 2048)
    assert load.counters_created == 1.7e9  # a new value means a new engine process
    assert parse_metrics("").block_size is None
    assert parse_metrics("").counters_created is None


def test_parse_models_separates_lora_cards() -> None:
    body = {"object": "list", "data": [
        {"id": "base", "root": "/models/base", "parent": None},
        {"id": "sql", "root": "/adapters/sql", "parent": "base"},
    ]}
    models = parse_models(body)
    assert models.models == ("base",)
    assert dict(models.lora_adapters) == {"sql": "/adapters/sql"}
    with pytest.raises(ValueError):
        parse_models({"data": "nope"})


def test_heartbeat_fields_are_the_contract_fields() -> None:
    from router.shared import contract

    fields = heartbeat_fields(replica_id="r", url="http://x", models=parse_models({"data": []}),
                              load=parse_metrics(METRICS), seed_fingerprint="ab", hash_verified="1",
                              key_mode="engine", num_blocks=5, now_s=1.5)
    expected = {getattr(contract, n) for n in dir(contract) if n.startswith("F_")}
    # the writer adds epoch, seq, entry_seq and redis_oom
    assert set(fields) == expected - {contract.F_EPOCH, contract.F_SEQ, contract.F_ENTRY_SEQ,
                                      contract.F_REDIS_OOM}
    assert fields[contract.F_PREFIX_CACHE_QUERIES] == 1000
    assert fields[contract.F_NUM_GPU_BLOCKS] == 2048


BASE = ["--engine-url", "http://127.0.0.1:1", "--kv-events-endpoint", "tcp://127.0.0.1:2",
        "--redis-url", "redis://127.0.0.1:3/0", "--replica-id", "r0"]


def test_config_precedence_flag_env_yaml(tmp_path: Path) -> None:
    yaml_file = tmp_path / "w.yaml"
    yaml_file.write_text("redis_prefix: fromyaml\nhash_seed: 7\nmetrics_port: 9000\n")
    env = {"WORKER_REDIS_PREFIX": "fromenv", "WORKER_CONFIG": str(yaml_file)}
    config = load_config([*BASE, "--metrics-port", "9100"], env)
    assert (config.redis_prefix, config.hash_seed, config.metrics_port) == ("fromenv", "7", 9100)
    assert config.url == "http://127.0.0.1:1"
    only_env = load_config([], {"WORKER_ENGINE_URL": "http://e:1", "WORKER_KV_EVENTS_ENDPOINT": "tcp://e:2",
                                "WORKER_REDIS_URL": "redis://r:6379", "WORKER_REPLICA_ID": "x",
                                "WORKER_KV_REPLAY_ENDPOINT": "tcp://e:3"})
    assert only_env.kv_replay_endpoint == "tcp://e:3"


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="--replica-id"):
        load_config(BASE[:-2], {})
    with pytest.raises(ConfigError, match="hash-algo"):
        load_config([*BASE, "--hash-algo", "md5"], {})
    for bad in ("-0.01", "1.5", "nan"):
        with pytest.raises(ConfigError, match="event-window-s"):
            load_config([*BASE, "--event-window-s", bad], {})
    assert load_config([*BASE, "--event-window-s", "0"], {}).event_window_s == 0
    assert load_config(BASE, {"WORKER_EVENT_WINDOW_S": "0.1"}).event_window_s == 0.1
    for bad in ("5", "inf", "nan"):
        with pytest.raises(ConfigError, match="state-ttl-s"):
            load_config([*BASE, "--state-ttl-s", bad], {})
    assert load_config(BASE, {"WORKER_STATE_TTL_S": "30"}).state_ttl_s == 30


def test_interval_log_writes_one_line_per_interval_with_a_count(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from router.shared.logs import IntervalLog

    log = IntervalLog(logging.getLogger("test.rate"), interval_s=3600.0)
    with caplog.at_level(logging.WARNING, logger="test.rate"):
        written = [log.warning("bad message %d", i) for i in range(1000)]
    assert written == [True] + [False] * 999
    assert [r.getMessage() for r in caplog.records] == ["bad message 0"]
    assert log.num_since == 999
    log._last = -1e9  # the interval is over: the next line carries the count
    with caplog.at_level(logging.WARNING, logger="test.rate"):
        assert log.warning("bad message %d", 1000)
    assert caplog.records[-1].getMessage() == "bad message 1000 (1000 times since the last line)"


def _events_for(tokens: list[int], hasher: BlockHasher) -> BlockStored:
    keys = hasher.keys(tokens)
    return BlockStored(block_hashes=keys, parent_block_hash=None, token_ids=tokens[: 16 * len(keys)],
                       block_size=16, lora_id=None, medium="GPU", lora_name=None)


def test_probe_verdicts_name_the_cause() -> None:
    tokens = probe_tokens(16, random.Random(0))
    assert len(tokens) == 33
    ours = BlockHasher(16, "sha256", "0")
    for engine, verified, cause in [
        (BlockHasher(16, "sha256", "0"), True, ""),
        (BlockHasher(16, "sha256", "42"), False, "PYTHONHASHSEED"),
        (BlockHasher(16, "sha256_cbor", "0"), False, "hash algorithm"),
    ]:
        catcher = ProbeCatcher(tokens, 16)
        catcher.observe(_events_for(list(range(40)), engine))  # another prompt: ignored
        assert not catcher.done.is_set()
        catcher.observe(_events_for(tokens, engine))
        assert catcher.done.is_set()
        verdict = judge(catcher, ours)
        assert verdict.verified is verified
        assert cause in verdict.cause


def test_probe_catches_blocks_split_over_events() -> None:
    tokens = probe_tokens(16, random.Random(1))
    hasher = BlockHasher(16, "sha256", "0")
    keys = hasher.keys(tokens)
    catcher = ProbeCatcher(tokens, 16)
    catcher.observe(BlockStored(block_hashes=keys[:1], parent_block_hash=None, token_ids=tokens[:16],
                                block_size=16, lora_id=None, medium="GPU", lora_name=None))
    assert not catcher.done.is_set()
    catcher.observe(BlockStored(block_hashes=keys[1:], parent_block_hash=keys[0],
                                token_ids=tokens[16:32], block_size=16, lora_id=None, medium="GPU",
                                lora_name=None))
    assert catcher.done.is_set() and judge(catcher, hasher).verified


def test_the_probe_ignores_offload_and_other_group_stores() -> None:
    # vLLM's offloading connector publishes host stores without tokens or parent: they would
    # match any prompt at block 0 (and an offloaded block size is no engine block size)
    tokens = probe_tokens(16, random.Random(2))
    hasher = BlockHasher(16, "sha256", "0")
    catcher = ProbeCatcher(tokens, 16)
    for medium, size, group in (("CPU", 16, None), ("CPU", 64, None), ("GPU", 64, 1)):
        catcher.observe(BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=[],
                                    block_size=size, lora_id=None, medium=medium, lora_name=None,
                                    group_idx=group))
        catcher.observe(BlockStored(block_hashes=[7], parent_block_hash=None,
                                    token_ids=tokens[:size], block_size=size, lora_id=None,
                                    medium=medium, lora_name=None, group_idx=group))
    assert not catcher.done.is_set() and catcher.engine_keys == [None, None]
    catcher.observe(_events_for(tokens, hasher))
    assert catcher.done.is_set() and judge(catcher, hasher).verified


def test_resident_after_counts_from_nothing_after_all_blocks_cleared() -> None:
    """vLLM publishes the ``AllBlocksCleared`` of ``/reset_prefix_cache`` with the next step's
    batch, before that step's stores: a full cache (63 of 63 blocks) then 3 stores is 3 blocks,
    not 66 (the capacity check refused such a batch, so the worker's set never followed a reset
    on a full engine)."""
    from router.shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
    from worker.capacity_guard import resident_after

    def store(n: int, medium: str | None = "GPU") -> BlockStored:
        return BlockStored(block_hashes=list(range(n)), parent_block_hash=None,
                           token_ids=[1] * 16 * n, block_size=16, lora_id=None, medium=medium,
                           lora_name=None)

    assert resident_after(63, [AllBlocksCleared(), store(3)]) == 3
    assert resident_after(63, [store(2), AllBlocksCleared(), store(3)]) == 3
    assert resident_after(10, [store(4), BlockRemoved(block_hashes=[1, 2], medium="GPU")]) == 12
    assert resident_after(10, [store(4, medium="CPU"), store(1, medium=None)]) == 11
