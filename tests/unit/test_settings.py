"""One settings mechanism (``router.settings.Settings``) for the router, the worker and the
emulator: flags, ``<PREFIX>_*`` environment variables and YAML from one declaration each."""

from __future__ import annotations

from pathlib import Path

import pytest

from router import config as router_config
from router.settings import ConfigError, Settings
from worker import report_config as worker_config
from worker.emulator import config as emulator_config

WORKER_ARGS = ["--engine-url", "http://127.0.0.1:1", "--kv-events-endpoint", "tcp://127.0.0.1:2",
               "--redis-url", "redis://127.0.0.1:3/0", "--replica-id", "r0"]


def test_the_three_configs_share_one_mechanism() -> None:
    settings = (router_config.SETTINGS, worker_config.SETTINGS, emulator_config.SETTINGS)
    assert all(isinstance(s, Settings) for s in settings)
    assert [s.env_prefix for s in settings] == ["ROUTER_", "WORKER_", "EMULATOR_"]
    # every field of each declaration has a flag, and the flags are what the parsers accept
    for s in settings:
        parser = s.parser()
        known = {a.dest for a in parser._actions}
        assert set(s.fields) <= known, s.prog


def test_emulator_settings_from_flag_env_and_yaml(tmp_path: Path) -> None:
    path = tmp_path / "emulator.yaml"  # vLLM's --config files spell keys with dashes
    path.write_text("block-size: 32\nmax_num_seqs: 7\ntime_scale: 4\n"
                    "lora-modules: [a=/x, b=/y]\nenable-prefix-caching: false\n")
    env = {"EMULATOR_CONFIG": str(path), "EMULATOR_MAX_NUM_SEQS": "9",
           "EMULATOR_SERVED_MODEL_NAME": "m1,m2"}
    cfg = emulator_config.from_args(["--time-scale", "2", "--num-gpu-blocks-override", "64"], env)
    assert cfg.block_size == 32  # YAML beats the default
    assert cfg.max_num_seqs == 9  # env beats YAML
    assert cfg.time_scale == 2.0  # the flag beats YAML
    assert cfg.lora_modules == (("a", "/x"), ("b", "/y"))
    assert cfg.served_model_names == ("m1", "m2") and cfg.enable_prefix_caching is False
    flags = emulator_config.from_args(
        ["tag", "--lora-modules", '{"name": "j", "path": "/p,q"}', "c=/z",
         "--served-model-name", "s1", "s2", "--enable-prompt-tokens-details"], env={})
    assert flags.model == "tag" and flags.served_model_names == ("s1", "s2")
    assert flags.lora_modules == (("j", "/p,q"), ("c", "/z")) and flags.enable_prompt_tokens_details


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--block-size", "x"], {}, "--block-size: bad value 'x' for block_size"),
    ([], {"EMULATOR_TIME_SCALE": "inf"}, "env EMULATOR_TIME_SCALE: bad value 'inf'"),
    (["--prefix-caching-hash-algo", "md5"], {}, "expected one of"),
    (["--log-level", "LOUD"], {}, "log_level"),
])
def test_emulator_bad_settings_are_one_line_errors(argv: list[str], env: dict[str, str],
                                                   message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        emulator_config.from_args(argv, env)


@pytest.mark.parametrize(("load", "argv", "prefix"), [
    (router_config.load_config, ["--replica", "http://a:1"], "ROUTER_"),
    (worker_config.load_config, WORKER_ARGS, "WORKER_"),
    (emulator_config.from_args, [], "EMULATOR_"),
])
def test_unknown_yaml_keys_and_bad_env_values_fail_alike(load, argv: list[str], prefix: str,  # type: ignore[no-untyped-def]
                                                         tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("nope: 1\n")
    with pytest.raises(ConfigError, match=f"config file {path}: unknown key 'nope'"):
        load([*argv, "--config", str(path)], {})
    with pytest.raises(ConfigError, match=f"env {prefix}BLOCK_SIZE: bad value 'big' for block_size"):
        load(argv, {f"{prefix}BLOCK_SIZE": "big"})


def test_worker_lists_and_required_settings_from_env(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing required settings: --engine-url, --replica-id"):
        worker_config.load_config(WORKER_ARGS[2:6], {})
    cfg = worker_config.load_config(WORKER_ARGS, {"WORKER_HASH_SEED": "", "WORKER_INDEX_STRIDE": "4"})
    assert cfg.hash_seed is None and cfg.index_stride == 4  # an empty optional value is unset
    routers = router_config.load_config(["--replica", "http://a:1", "--replica", "http://b:2,http://c:3"],
                                        {"ROUTER_FALLBACK_REPLICA": "http://d:4"})
    assert routers.replicas == ("http://a:1", "http://b:2", "http://c:3")
    assert routers.fallback_replicas == ("http://d:4",)
