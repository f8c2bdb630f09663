"""Router config precedence: CLI flag > ROUTER_* env > YAML > default; validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.service.config import ConfigError, RouterConfig, load_config


def test_defaults_and_cli(tmp_path: Path) -> None:
    cfg = load_config(["--replica", "http://127.0.0.1:1", "--replica", "http://127.0.0.1:2"], env={})
    assert cfg.replicas == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert cfg.policy == "prefix" and cfg.block_size == 16 and cfg.load_factor == 2.0
    assert cfg.port == 8000 and cfg.max_body_bytes == 32 * 1024 * 1024
    assert cfg.stream_read_interval_s == 0.05
    tuned = load_config(["--replica", "http://127.0.0.1:1", "--stream-read-interval-s", "0"],
                        env={"ROUTER_STREAM_READ_INTERVAL_S": "0.2"})
    assert tuned.stream_read_interval_s == 0.0  # CLI beats env; 0: read again at once
    assert load_config(["--replica", "http://127.0.0.1:1"],
                       env={"ROUTER_STREAM_READ_INTERVAL_S": "0.2"}).stream_read_interval_s == 0.2


def test_precedence_cli_env_yaml(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("redis_url: redis://127.0.0.1:1\nblock_size: 32\npolicy: round_robin\n"
                    "load_factor: 1.5\nreplicas: [http://a:1, http://b:2]\n")
    env = {"ROUTER_CONFIG": str(path), "ROUTER_BLOCK_SIZE": "64", "ROUTER_POLICY": "least_loaded"}
    cfg = load_config(["--policy", "consistent_hash"], env=env)
    assert cfg.block_size == 64  # env beats YAML
    assert cfg.policy == "consistent_hash"  # CLI beats env
    assert cfg.load_factor == 1.5  # YAML beats default
    assert cfg.replicas == ("http://a:1", "http://b:2")
    assert cfg.config == str(path)
    env_list = load_config([], env={"ROUTER_REPLICAS": "http://a:1, http://b:2"})
    assert env_list.replicas == ("http://a:1", "http://b:2")


@pytest.mark.parametrize("argv, message", [
    ([], "need --redis-url"),
    (["--replica", "a:1"], "http://"),
    (["--replica", "http://a:1", "--policy", "best"], "policy"),
    (["--replica", "http://a:1", "--load-factor", "0.5"], "load_factor"),
    (["--replica", "http://a:1", "--block-size", "x"], "block_size"),
    (["--replica", "http://a:1", "--hash-algo", "md5"], "hash_algo"),
    (["--replica", "http://a:1#x"], "data-parallel rank"),
    (["--replica", "http://a:1#-1"], "data-parallel rank"),
    (["--redis-url", "redis://r:1/0", "--fallback-replica", "http://a:1#"], "data-parallel rank"),
    (["--replica", "http://a:1", "--stream-read-interval-s", "-0.01"], "stream_read_interval_s"),
])
def test_invalid(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(argv, env={})


def test_yaml_unknown_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("nope: 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(["--config", str(path)], env={})


def test_frozen() -> None:
    cfg = RouterConfig(replicas=("http://a:1",))
    with pytest.raises(AttributeError):
        cfg.port = 1  # type: ignore[misc]


def test_policy_params_come_from_the_settings_with_one_set_of_defaults() -> None:
    import dataclasses

    from router.decision.policy import PolicyParams

    fleet = {"replicas": ["http://127.0.0.1:9"]}
    assert RouterConfig(**fleet).policy_params() == PolicyParams()
    changed = RouterConfig(**fleet, block_size=32, load_factor=3.0, load_headroom=1, queue_slack_tokens=7,
                           recompute_penalty=2.0, min_hit_fraction=0.5, min_affinity_blocks=5,
                           consistent_hash_tokens=640, cold_candidates=2, cold_queue_slack_tokens=9,
                           ttft_prior_tokens_per_s=1000.0, ttft_evicted_reuse=0.25,
                           cpu_load_tokens_per_s=5e4)
    params = changed.policy_params()
    assert params.consistent_hash_blocks == 20 and params.evicted_reuse == 0.25
    for f in dataclasses.fields(PolicyParams):
        if hasattr(changed, f.name):
            assert getattr(params, f.name) == getattr(changed, f.name) != getattr(PolicyParams(), f.name), f.name


def test_a_static_replica_url_may_name_a_data_parallel_rank() -> None:
    from router.decision.fleet import Fleet
    from router.shared.hashing import BlockHasher

    cfg = load_config(["--replica", "http://a:1#0", "--replica", "http://a:1/#1",
                       "--replica", "https://b/v"], env={})
    fleet = Fleet(cfg, BlockHasher(16, "sha256"))
    assert {rid: (r.url, r.dp_rank) for rid, r in fleet.replicas.items()} == {
        "a:1#0": ("http://a:1", 0), "a:1#1": ("http://a:1", 1), "b:443": ("https://b/v", None)}
    assert fleet.add_fallbacks([], ("http://c:2#3",)) == 1
    assert (fleet.replicas["c:2#3"].url, fleet.replicas["c:2#3"].dp_rank) == ("http://c:2", 3)


@pytest.mark.parametrize("urls, message", [
    (["http://a:1#99999999999999999999"], r"rank must be at most 2147483647"),
    (["http://a:1#2147483648"], r"rank must be at most 2147483647"),
    (["http://a:1#01"], r"without leading zeros, got 'http://a:1#01'"),
    (["http://a:1#1", "http://a:1/#1"], r"'http://a:1/#1' names the same replica a:1#1 as "
                                        r"'http://a:1#1'"),
    (["http://A:80/x", "http://a/y"], r"names the same replica a:80"),
    (["http://a:1", "http://a:1#0"], r"engine a:1 is listed whole \('http://a:1'\) and by rank "
                                     r"\('http://a:1#0'\)"),
    (["http://a:1#0", "http://a:1/"], r"engine a:1 is listed whole"),
    (["http://a:99999"], r"replica URL 'http://a:99999': Port out of range"),
    (["http://#1"], r"replica URL has no host"),
])
def test_static_replica_lists_that_name_a_target_twice_or_an_absurd_rank_are_refused(
        urls: list[str], message: str) -> None:
    for flag, base in (("--replica", []), ("--fallback-replica", ["--redis-url", "redis://r:1/0"])):
        argv = [*base, *(arg for url in urls for arg in (flag, url))]
        with pytest.raises(ConfigError, match=message):
            load_config(argv, env={})


def test_the_largest_rank_and_distinct_engines_ranks_are_accepted() -> None:
    cfg = load_config(["--replica", "http://a:1#2147483647", "--replica", "http://a:2",
                       "--replica", "http://a:1#0", "--replica", "http://b:1#0"], env={})
    assert len(cfg.replicas) == 4
