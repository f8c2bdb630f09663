"""Secrets from files or the environment, never the command line: the Redis password of the
router and the worker (``--redis-password-file``, ``ROUTER_/WORKER_REDIS_PASSWORD``,
``REDIS_PASSWORD``), and the old flag that still works with a warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from router.service import config as router_config
from router.shared.secrets import MAX_SECRET_BYTES, SecretError, read_secret_file
from worker import report_config as worker_config

WORKER_ARGS = ["--engine-url", "http://127.0.0.1:8000", "--kv-events-endpoint", "tcp://127.0.0.1:5557",
               "--redis-url", "redis://127.0.0.1:6379/0", "--replica-id", "r0"]
ROUTER_ARGS = ["--redis-url", "redis://127.0.0.1:6379/0"]


def router_password(argv: list[str], env: dict[str, str]) -> str | None:
    return router_config.load_config(ROUTER_ARGS + argv, env).redis_password


def worker_password(argv: list[str], env: dict[str, str]) -> str | None:
    return worker_config.load_config(WORKER_ARGS + argv, env).redis_password


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "redis-password"
    path.write_text("s3cret pass\n")  # as `kubectl create secret --from-file` often leaves it
    return path


@pytest.mark.parametrize(("password", "prefix"), [(router_password, "ROUTER_"),
                                                  (worker_password, "WORKER_")])
def test_password_sources_and_precedence(password, prefix: str, secret_file: Path) -> None:  # type: ignore[no-untyped-def]
    assert password([], {}) is None
    assert password(["--redis-password-file", str(secret_file)], {}) == "s3cret pass"
    assert password([], {f"{prefix}REDIS_PASSWORD_FILE": str(secret_file)}) == "s3cret pass"
    assert password([], {f"{prefix}REDIS_PASSWORD": "from-env"}) == "from-env"
    # the conventional variable comes last
    assert password([], {"REDIS_PASSWORD": "conventional"}) == "conventional"
    assert password([], {f"{prefix}REDIS_PASSWORD": "own", "REDIS_PASSWORD": "conventional"}) == "own"
    assert password(["--redis-password-file", str(secret_file)],
                    {"REDIS_PASSWORD": "conventional"}) == "s3cret pass"


@pytest.mark.parametrize(("load", "args", "error", "prefix"), [
    (router_config.load_config, ROUTER_ARGS, router_config.ConfigError, "ROUTER_"),
    (worker_config.load_config, WORKER_ARGS, worker_config.ConfigError, "WORKER_"),
])
def test_bad_secret_settings_are_config_errors(load, args, error, prefix: str,  # type: ignore[no-untyped-def]
                                               secret_file: Path, tmp_path: Path) -> None:
    with pytest.raises(error, match="both set"):
        load([*args, "--redis-password-file", str(secret_file)], {f"{prefix}REDIS_PASSWORD": "x"})
    with pytest.raises(error, match="cannot read secret file"):
        load([*args, "--redis-password-file", str(tmp_path / "missing")], {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(error, match="is empty"):
        load([*args, "--redis-password-file", str(tmp_path / "empty")], {})


@pytest.mark.parametrize("password", [router_password, worker_password])
def test_old_flag_works_and_warns(password, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    name = "router.shared.secrets"
    with caplog.at_level(logging.WARNING, logger=name):
        assert password(["--redis-password", "on-the-command-line"], {}) == "on-the-command-line"
    assert "--redis-password puts the secret on the command line" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=name):
        password([], {"REDIS_PASSWORD": "x"})
    assert caplog.text == ""


def test_password_stays_out_of_reprs(secret_file: Path) -> None:
    cfg = router_config.load_config([*ROUTER_ARGS, "--redis-password-file", str(secret_file)], {})
    wcfg = worker_config.load_config([*WORKER_ARGS, "--redis-password-file", str(secret_file)], {})
    assert "s3cret" not in repr(cfg) and "s3cret" not in repr(wcfg)


def test_secret_file_rules(tmp_path: Path) -> None:
    path = tmp_path / "s"
    path.write_bytes(b"abc\r\n")
    assert read_secret_file(str(path)) == "abc"
    path.write_bytes(b"  keep spaces  \n\n")  # only one newline is the file's; the rest is the secret
    assert read_secret_file(str(path)) == "  keep spaces  \n"
    path.write_bytes(b"x" * (MAX_SECRET_BYTES + 1))
    with pytest.raises(SecretError, match="larger than"):
        read_secret_file(str(path))
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(SecretError, match="not UTF-8"):
        read_secret_file(str(path))
