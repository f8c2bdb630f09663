"""One settings mechanism (``router.shared.settings.Settings``) for the router, the worker and the
emulator: flags, ``<PREFIX>_*`` environment variables and YAML from one declaration each."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.service import config as router_config
from router.shared.settings import ConfigError, Settings
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
    with pytest.raises(ConfigError, match=f"config file {path}, line 1: unknown key 'nope'"):
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


@pytest.mark.parametrize("load", [router_config.load_config, worker_config.load_config,
                                  emulator_config.from_args])
def test_an_unknown_flag_is_one_line_naming_it_and_pointing_at_help(load) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as exc:
        load(["--blok-size", "3"], {})
    message = str(exc.value)
    assert "\n" not in message and "usage:" not in message
    assert "--blok-size (did you mean --block-size?)" in message and message.endswith("--help")


def test_the_commands_print_an_unknown_flag_as_one_line_exit_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    from router.service.server import main as router_main
    from worker.emulator.app import main as emulator_main
    from worker.report import main as worker_main

    for main, prog in ((router_main, "prefix-router serve"), (worker_main, "prefix-worker report"),
                       (emulator_main, "prefix-worker emulate")):
        assert main(["--no-such-flag"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--no-such-flag" in err and f"{prog} --help" in err, err


def test_a_broken_yaml_file_is_one_line_with_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("block_size: 16\nreplicas: [http://a:1\nhash_seed: 1\n")
    with pytest.raises(ConfigError) as exc:
        router_config.load_config(["--config", str(path)], {})
    message = str(exc.value)
    assert "\n" not in message, message
    assert message.startswith(f"config file {path}: line 3, column 10: "), message
    path.write_text("a: b: c\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: line 1, column 5: mapping values are "
                                          r"not allowed here$"):
        worker_config.load_config(["--config", str(path)], {})


def test_a_config_file_that_is_not_utf8_is_one_line_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from router.service.server import main as router_main

    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(ConfigError, match=f"^config file {path}: not UTF-8 text "
                                          r"\(byte 0xff at offset 0\)$"):
        router_config.load_config(["--config", str(path)], {})
    assert router_main(["--config", str(path), "--replica", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "Traceback" not in err, err


def test_a_yaml_key_given_twice_is_refused_with_its_lines(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("block_size: 16\nvnodes: 8\nblock_size: 32\nreplica: [http://a:1]\n")
    with pytest.raises(ConfigError, match=f"^config file {path}: line 3, column 1: duplicate key "
                                          r"'block_size' \(first on line 1\)$"):
        router_config.load_config(["--config", str(path)], {})
    path.write_text("block_size: 16\nreplica: [http://a:1]\n")  # unique keys still load
    assert router_config.load_config(["--config", str(path)], {}).block_size == 16


def test_an_empty_required_setting_says_it_must_not_be_empty() -> None:
    argv = [*WORKER_ARGS[:-1], ""]
    with pytest.raises(ConfigError, match=r"^--replica-id: replica_id must not be empty$"):
        worker_config.load_config(argv, {})
    with pytest.raises(ConfigError, match=r"^env WORKER_REPLICA_ID: replica_id must not be empty$"):
        worker_config.load_config(WORKER_ARGS[:-2], {"WORKER_REPLICA_ID": ""})


@pytest.mark.parametrize(("load", "argv", "prefix", "flag", "setting"), [
    (router_config.load_config, ["--replica", "http://a:1"], "ROUTER_", "--block-size",
     "block_size"),
    (worker_config.load_config, WORKER_ARGS, "WORKER_", "--block-size", "block_size"),
    (emulator_config.from_args, [], "EMULATOR_", "--block-size", "block_size"),
    (router_config.load_config, ["--replica", "http://a:1"], "ROUTER_", "--vnodes", "vnodes"),
    (worker_config.load_config, WORKER_ARGS, "WORKER_", "--index-stride", "index_stride"),
    (emulator_config.from_args, [], "EMULATOR_", "--max-num-seqs", "max_num_seqs"),
])
def test_range_errors_name_the_flag_env_var_or_file_and_key(  # type: ignore[no-untyped-def]
        load, argv: list[str], prefix: str, flag: str, setting: str, tmp_path: Path) -> None:
    env_name = prefix + setting.upper()
    with pytest.raises(ConfigError, match=f"^env {env_name}: {setting} must be >= 1, got 0$"):
        load(argv, {env_name: "0"})
    with pytest.raises(ConfigError, match=f"^{flag}: {setting} must be >= 1, got 0$"):
        load([*argv, flag, "0"], {env_name: "5"})  # the flag wins, so the flag is named
    path = tmp_path / "c.yaml"
    path.write_text(f"{setting.replace('_', '-')}: 0\n")
    with pytest.raises(ConfigError, match=f"^config file {path}, line 1, key "
                                          f"{setting.replace('_', '-')}: "
                                          f"{setting} must be >= 1, got 0$"):
        load([*argv, "--config", str(path)], {})


def test_every_validation_names_its_source() -> None:
    worker_bad = {"--engine-url": "ftp://e", "--kv-events-endpoint": "e:1",
                  "--redis-url": "mysql://r", "--log-format": "xml", "--hash-algo": "md5",
                  "--kv-tiers": "TAPE", "--metrics-port": "70000", "--replay-timeout-s": "0",
                  "--log-level": "loud", "--data-parallel-size": "0"}
    for flag, value in worker_bad.items():
        env_name = "WORKER_" + flag[2:].replace("-", "_").upper()
        env = {f"WORKER_{a[2:].replace('-', '_').upper()}": b
               for a, b in zip(WORKER_ARGS[::2], WORKER_ARGS[1::2], strict=True)}
        with pytest.raises(ConfigError, match=f"^env {env_name}: "):
            worker_config.load_config([], {**env, env_name: value})
    router_bad = {"--port": "70000", "--policy": "best", "--load-factor": "0.5",
                  "--min-hit-fraction": "2", "--connect-timeout-s": "0",
                  "--otlp-traces-endpoint": "grpc://x", "--redis-url": "mysql://r"}
    for flag, value in router_bad.items():
        with pytest.raises(ConfigError, match=f"^{flag}: "):
            router_config.load_config(["--replica", "http://a:1", flag, value], {})
    with pytest.raises(ConfigError, match=r"^env ROUTER_REPLICAS: replica URL must start"):
        router_config.load_config([], {"ROUTER_REPLICAS": "a:1"})
    emulator_bad = {"--port": "70000", "--time-scale": "0", "--model-layers": "0",
                    "--num-cpu-blocks-override": "0", "--kv-offloading-size": "0",
                    "--vocab-size": "0", "--max-model-len": "100000000",
                    "--kv-events-config": "{", "--lora-modules": "nopath"}
    for flag, value in emulator_bad.items():
        with pytest.raises(ConfigError, match=f"^{flag}: "):
            emulator_config.from_args([flag, value], {})


@pytest.mark.parametrize(("text", "shape"), [("hash_seed: {a: 1}", "a mapping"),
                                             ("hash_seed: [1, 2]", "a list"),
                                             ("block_size: [16]", "a list"),
                                             ("replicas: [{url: 'http://a:1'}]", "a mapping"),
                                             ("block_size:", "nothing")])
def test_a_yaml_mapping_or_list_for_a_scalar_setting_is_refused(text: str, shape: str,
                                                                tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"replica: [http://a:1]\n{text}\n" if "replicas" not in text else text)
    key = text.split(":", 1)[0]
    line = 1 if "replicas" in text else 2
    with pytest.raises(ConfigError, match=f"^config file {path}, line {line}, key {key}: bad "
                                          f"value .* for {key}: expected .*, got {shape}$"):
        router_config.load_config(["--config", str(path)], {})


@pytest.mark.parametrize(("text", "expected"), [
    ('block_size: "16"', "expected `int`, got `str`"),  # quoted: a string
    ("block_size: 16.0", "expected `int`, got `float`"),
    ("block_size: true", "expected `int`, got `bool`"),
    ("stall_timeout_s: '30'", "expected `float`, got `str`"),
    ("trust_request_chat_template: 'yes'", "expected `bool`, got `str`"),
    ("trust_request_chat_template: 1", "expected `bool`, got `int`"),
    ("model: true", "expected `int | str`, got `bool`"),
    ("replicas: [http://a:1, 7]", "expected `str`, got `int` - at `$[1]`"),
])
def test_a_yaml_value_of_the_wrong_type_is_one_line_with_file_line_and_key(
        text: str, expected: str, tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"# the fleet\nreplica: [http://a:1]\n{text}\n" if "replicas" not in text
                    else f"# the fleet\n\n{text}\n")
    key = text.split(":", 1)[0]
    with pytest.raises(ConfigError) as exc:
        router_config.load_config(["--config", str(path)], {})
    message = str(exc.value)
    assert message.startswith(f"config file {path}, line 3, key {key}: bad value "), message
    assert message.endswith(f" for {key}: {expected}"), message
    assert "\n" not in message


def test_yaml_values_of_the_right_type_pass(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("replica: http://a:1\nblock_size: 32\nstall_timeout_s: 30\nhash_seed: 0\n"
                    "trust_request_chat_template: true\nmodel: m\notlp_traces_endpoint:\n")
    cfg = router_config.load_config(["--config", str(path)], {})
    assert (cfg.replicas, cfg.block_size, cfg.stall_timeout_s, cfg.hash_seed) == (
        ("http://a:1",), 32, 30.0, "0")
    assert cfg.trust_request_chat_template is True and cfg.otlp_traces_endpoint is None
    # flags and env vars are strings by nature: "16" is an integer there
    assert router_config.load_config(["--replica", "http://a:1", "--block-size", "16"],
                                     {"ROUTER_STALL_TIMEOUT_S": "30"}).block_size == 16


@pytest.mark.parametrize("replica_id", ["a#1", "#", "engine#0"])
def test_a_replica_id_holding_the_rank_separator_is_refused(replica_id: str) -> None:
    argv = [*WORKER_ARGS[:-2], "--replica-id", replica_id]
    with pytest.raises(ConfigError, match=f"^--replica-id: replica id '{replica_id}' must not "
                                          "contain '#'"):
        worker_config.load_config(argv, {})
    with pytest.raises(ConfigError, match=r"^env WORKER_REPLICA_ID: replica id"):
        worker_config.load_config(WORKER_ARGS[:-2], {"WORKER_REPLICA_ID": replica_id})
    # braces are fine: every key of the replica keeps one hash tag (router.shared.contract)
    assert worker_config.load_config([*WORKER_ARGS[:-2], "--replica-id", "a{b}"], {}).replica_id \
        == "a{b}"


def test_the_router_yaml_takes_replica_and_replicas(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    for key in ("replica", "replicas", "fallback-replica", "fallback_replicas"):
        path.write_text(f"redis_url: redis://r:1\n{key}: [http://a:1, http://b:2]\n")
        cfg = router_config.load_config(["--config", str(path)], {})
        name = "fallback_replicas" if key.startswith("fallback") else "replicas"
        assert getattr(cfg, name) == ("http://a:1", "http://b:2"), key
    path.write_text("replica: [http://a:1]\nreplicas: [http://b:2]\n")
    with pytest.raises(ConfigError, match="key replicas: replicas is given twice"):
        router_config.load_config(["--config", str(path)], {})
    path.write_text("dp: 2\n")  # the emulator's -dp alias, as a YAML key too
    assert emulator_config.from_args(["--config", str(path)], {}).data_parallel_size == 2


def test_a_misspelled_environment_variable_is_named_and_others_are_left_alone() -> None:
    """``ROUTER_POLCY`` was ignored without a word while flags and YAML keys get a hint (issue
    34's reviewer); names close to no setting (Kubernetes service links) stay quiet."""
    env = {"ROUTER_POLCY": "ttft", "ROUTER_POLICY": "prefix", "ROUTER_SERVICE_HOST": "10.0.0.1",
           "ROUTER_REPLICA": "http://a:1", "WORKER_ENGINE_UR": "http://e:8000", "HOME": "/root"}
    assert router_config.SETTINGS.misspelled_env(env) == [
        "ignoring env ROUTER_POLCY: no such setting (did you mean ROUTER_POLICY?)"]
    assert worker_config.SETTINGS.misspelled_env(env) == [
        "ignoring env WORKER_ENGINE_UR: no such setting (did you mean WORKER_ENGINE_URL?)"]
