"""Helpers for integration tests: start real processes on loopback and wait on conditions."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from loadtest.redis_server import free_port, terminate

__all__ = ["free_port", "start_process", "stop_process", "wait_for"]

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float = 15.0, interval_s: float = 0.05,
             message: str = "condition") -> T:
    """Poll ``condition`` until it returns a truthy value; raise ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # the condition may fail while a server starts
            last_exc = exc
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {message}; last error: {last_exc!r}")


def start_process(args: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a command with the current environment; its output goes to a temporary file
    (a pipe nobody reads would block a chatty server)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(list(args), env=full_env, stdout=log, stderr=subprocess.STDOUT)
    proc._log = log  # type: ignore[attr-defined]
    return proc


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> str:
    """Terminate ``proc`` (SIGTERM, then SIGKILL) and return its combined output."""
    terminate(proc, timeout_s)
    log = getattr(proc, "_log", None)
    if log is None:
        return ""
    log.seek(0)
    out: bytes = log.read()
    log.close()
    return out.decode(errors="replace")


PYTHON = sys.executable


# the rest of a fake replica script after its ``completions`` handler (health, models, serving)
FAKE_REPLICA_TAIL = """
async def health(request):
    return web.json_response({})
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "fixed", "object": "model"}]})
app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""
