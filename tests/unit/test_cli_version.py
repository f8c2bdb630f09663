"""``--version`` on every CLI and subcommand prints "PROG VERSION" and exits 0; JSON log lines."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from importlib import metadata

import pytest

from router.shared.logs import REQUEST_ID, JsonFormatter

VERSION = metadata.version("prefix-router")


@pytest.mark.parametrize(("module", "args", "prog"), [
    ("router.cli", ["--version"], "prefix-router"),
    ("router.cli", ["serve", "--version"], "prefix-router"),
    ("router.cli", ["hash", "--version"], "prefix-router"),
    ("worker.cli", ["--version"], "prefix-worker"),
    ("worker.cli", ["report", "--version"], "prefix-worker"),
    ("loadtest.cli", ["--version"], "prefix-loadtest"),
    # every subcommand, the ones with required arguments too
    ("router.cli", ["capacity", "--version"], "prefix-router"),
    ("router.cli", ["audit", "--version"], "prefix-router"),
    ("router.cli", ["auth", "--version"], "prefix-router"),
    ("worker.cli", ["emulate", "--version"], "prefix-worker"),
    ("loadtest.cli", ["replay", "--version"], "prefix-loadtest"),
    ("loadtest.cli", ["compare", "--version"], "prefix-loadtest"),
    ("loadtest.cli", ["demo", "--version"], "prefix-loadtest"),
    ("loadtest.cli", ["ab", "--version"], "prefix-loadtest"),
])
@pytest.mark.slow  # starts a Python process
def test_version(module: str, args: list[str], prog: str) -> None:
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stdout) == (0, f"{prog} {VERSION}\n"), result.stderr


def test_json_log_line_carries_the_request_id() -> None:
    formatter = JsonFormatter()
    record = logging.LogRecord("router.edges.proxy", logging.WARNING, __file__, 1, "retrying %s", ("r1",),
                               None)
    token = REQUEST_ID.set("req-9")
    try:
        line = json.loads(formatter.format(record))
    finally:
        REQUEST_ID.reset(token)
    assert line["request_id"] == "req-9" and line["message"] == "retrying r1"
    assert (line["level"], line["logger"]) == ("warning", "router.edges.proxy")
    assert line["ts"].endswith("+00:00")
    assert json.loads(formatter.format(record))["request_id"] is None
    try:
        raise ValueError("boom")
    except ValueError:
        record.exc_info = sys.exc_info()
    assert "ValueError: boom" in json.loads(formatter.format(record))["exc_info"]
