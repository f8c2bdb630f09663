"""What the three command lines say when they are stopped or misused, run as real processes:
Ctrl-C while they load their modules ends them with status 130 and no traceback; an unknown
command, flag or YAML key is one line naming the closest known one; a model path that does
not exist is named as such.

The Ctrl-C is sent once ``-X importtime`` shows the CLI module loading (argparse, imported
inside its guarded block), so it lands in the seconds of imports a busy machine takes, not
in the interpreter's own start (``site``), which no program code can guard.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from loadtest.harness.processes import PYTHON
from tests.integration.test_startup_stop import closed_port

pytestmark = pytest.mark.timeout(120)

LOADING = re.compile(r"\|\s+argparse$")  # -X importtime's line once argparse has loaded


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", *args], capture_output=True, text=True, timeout=60,
                          check=False)


@pytest.mark.parametrize("command", [
    ["router.cli", "serve", "--replica", "http://127.0.0.1:9"],
    ["worker.cli", "report", "--engine-url", "http://127.0.0.1:9", "--replica-id", "r0",
     "--kv-events-endpoint", "tcp://127.0.0.1:9", "--redis-url", "redis://127.0.0.1:9/0"],
    ["loadtest.cli", "replay", "--target", "http://127.0.0.1:9", "--limit", "1"],
], ids=["router", "worker", "loadtest"])
def test_ctrl_c_while_loading_exits_130_without_a_traceback(command: list[str]) -> None:
    command = [c.replace(":9", f":{closed_port()}") for c in command]
    proc = subprocess.Popen([PYTHON, "-X", "importtime", "-m", *command],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen: list[str] = []
    for line in proc.stderr:  # until the CLI module's guarded imports are under way
        seen.append(line)
        if LOADING.search(line.rstrip()):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    text = out + "".join(seen) + err
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert proc.returncode == 130, text[-3000:]


@pytest.mark.parametrize(("args", "expected"), [
    (["router.cli", "serv"], "prefix-router: error: unknown command 'serv' (did you mean serve?); "
     "commands: hash, capacity, audit, auth, serve; see prefix-router --help"),
    (["worker.cli", "emulte"], "prefix-worker: error: unknown command 'emulte' (did you mean "
     "emulate?); commands: emulate, report; see prefix-worker --help"),
    (["loadtest.cli", "dmo"], "prefix-loadtest: error: unknown command 'dmo' (did you mean "
     "demo?); commands: replay, compare, demo, ab, fidelity; see prefix-loadtest --help"),
    (["loadtest.cli", "demo", "--speedupp", "3"],  # was: the top-level usage, 4 lines
     "prefix-loadtest demo: error: unknown argument --speedupp (did you mean --speedup?); "
     "see prefix-loadtest demo --help"),
    (["loadtest.cli", "demo", "--bogus"],
     "prefix-loadtest demo: error: unknown argument --bogus; see prefix-loadtest demo --help"),
    (["router.cli", "hash", "--blok-size", "4"],
     "prefix-router hash: error: unknown argument --blok-size (did you mean --block-size?); "
     "see prefix-router hash --help"),
    (["router.cli", "serve", "--bogus"],  # no near flag, no hint (was "did you mean --host?")
     "prefix-router serve: error: unknown argument --bogus; see prefix-router serve --help"),
], ids=["router-command", "worker-command", "loadtest-command", "loadtest-flag",
        "loadtest-far-flag", "router-hash-flag", "router-serve-far-flag"])
def test_usage_errors_are_one_line_naming_the_closest(args: list[str], expected: str) -> None:
    result = run(*args)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [expected]


def test_unknown_yaml_key_names_the_closest_setting(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("replicas: [http://127.0.0.1:9]\nblok_size: 32\n")
    result = run("router.cli", "serve", "--config", str(path))
    assert result.returncode == 2
    assert result.stderr == (f"prefix-router serve: error: config file {path}, line 2: unknown key "
                             "'blok_size' (did you mean block_size?)\n")


def test_capacity_of_a_missing_model_directory_says_it_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "models" / "Qwen3-8B"
    result = run("router.cli", "capacity", str(missing))
    assert result.returncode == 2
    assert result.stderr == (f"prefix-router capacity: error: {missing}: no such directory "
                             "(give a model directory holding config.json, or the shape "
                             "flags)\n")
    (tmp_path / "empty").mkdir()
    result = run("router.cli", "capacity", str(tmp_path / "empty"))
    assert result.stderr.strip().endswith("has no config.json")


WORKER = ["worker.cli", "report", "--engine-url", "http://127.0.0.1:9", "--kv-events-endpoint",
          "tcp://127.0.0.1:9", "--redis-url", "redis://127.0.0.1:9/0"]


@pytest.mark.parametrize(("args", "env", "yaml", "expected"), [
    (["router.cli", "serve", "--replica", "http://127.0.0.1:9"], {"ROUTER_BLOCK_SIZE": "0"}, None,
     "prefix-router serve: error: env ROUTER_BLOCK_SIZE: block_size must be >= 1, got 0"),
    (["router.cli", "serve", "--replica", "http://127.0.0.1:9"], {}, "hash_seed: {a: 1}\n",
     "prefix-router serve: error: config file {yaml}, line 1, key hash_seed: bad value {{'a': 1}} for "
     "hash_seed: expected a string, got a mapping"),
    (["router.cli", "serve"], {}, "replicas: [http://127.0.0.1:9\nport: 1\n",
     "prefix-router serve: error: config file {yaml}: line 2, column 5: expected ',' or ']', "
     "but got ':' (while parsing a flow sequence)"),
    ([*WORKER, "--replica-id", "a#1"], {}, None,
     "prefix-worker report: error: --replica-id: replica id 'a#1' must not contain '#': it "
     "separates an engine's data-parallel ranks (name#rank)"),
    (["router.cli", "serve", "--replica", "http://127.0.0.1:9"], {"ROUTER_API_KEYS": "/keys"},
     None, "prefix-router serve: error: env ROUTER_API_KEYS: api_keys needs "
     "cache_salt_secret_file (every router process must derive the same per-tenant cache salts)"),
    # issue 29 review: a query or fragment in an engine URL (API paths are appended to it)
    (["router.cli", "serve"], {"ROUTER_REPLICAS": "http://127.0.0.1:9?x=1#1"}, None,
     "prefix-router serve: error: env ROUTER_REPLICAS: replica URL 'http://127.0.0.1:9?x=1#1' "
     "must not have a query ('?...'): give the engine's base URL"),
    (["router.cli", "serve"], {}, "port: 1\nreplicas:\n  - http://127.0.0.1:9/v1?a=b\n",
     "prefix-router serve: error: config file {yaml}, line 2, key replicas: replica URL "
     "'http://127.0.0.1:9/v1?a=b' must not have a query ('?...'): give the engine's base URL"),
    ([*WORKER, "--replica-id", "a"], {"WORKER_ADVERTISE_URL": "http://127.0.0.1:9/#1"}, None,
     "prefix-worker report: error: env WORKER_ADVERTISE_URL: advertise_url "
     "'http://127.0.0.1:9/#1' must not have a fragment ('#...'): give the engine's base URL "
     "(a data-parallel rank goes in --data-parallel-size, not the URL)"),
    (["worker.cli", "report", "--kv-events-endpoint", "tcp://127.0.0.1:9", "--redis-url",
      "redis://127.0.0.1:9/0", "--replica-id", "a"], {"WORKER_ENGINE_URL": "http://127.0.0.1:9#"},
     None, "prefix-worker report: error: env WORKER_ENGINE_URL: engine_url "
     "'http://127.0.0.1:9#' must not have a fragment ('#...'): give the engine's base URL "
     "(a data-parallel rank goes in --data-parallel-size, not the URL)"),
    ([*WORKER, "--replica-id", "a", "--advertise-url", "http://h:8000?token=1"], {}, None,
     "prefix-worker report: error: --advertise-url: advertise_url 'http://h:8000?token=1' must "
     "not have a query ('?...'): give the engine's base URL"),
], ids=["env-range", "yaml-mapping", "yaml-syntax", "replica-id-separator", "env-api-keys",
        "env-replica-query", "yaml-replica-query", "env-advertise-fragment",
        "env-engine-fragment", "flag-advertise-query"])
def test_settings_errors_name_the_source_actually_used(
        tmp_path: Path, args: list[str], env: dict[str, str], yaml: str | None,
        expected: str) -> None:
    path = tmp_path / "settings.yaml"
    if yaml is not None:
        path.write_text(yaml)
        args = [*args, "--config", str(path)]
    result = subprocess.run([PYTHON, "-m", *args], capture_output=True, text=True, timeout=60,
                            check=False, env={**os.environ, **env})
    assert result.returncode == 2
    assert result.stderr.splitlines() == [expected.format(yaml=path)]
