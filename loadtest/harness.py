"""Start real processes (emulators, workers, routers, helpers) on loopback and wait on
conditions: the one harness of the tests and the benchmarks. Does process I/O.

A started process writes its combined output to a temporary file (a pipe nobody reads would
block a chatty server); ``stop_process`` stops it (SIGTERM, then SIGKILL) and returns that
output, so a failing test or benchmark can show it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from loadtest.redis_server import free_port, terminate

__all__ = ["EMULATE", "PYTHON", "cpu_seconds", "free_port", "start_process", "stop_process", "wait_for"]

T = TypeVar("T")
PYTHON = sys.executable
# ``prefix-worker emulate`` on loopback, port 0 (replica i on an ephemeral port): the emulator's
# command line, followed by the caller's own flags (a later flag overrides, e.g. ``--port``).
EMULATE = [PYTHON, "-m", "worker.cli", "emulate", "--host", "127.0.0.1", "--port", "0"]


def wait_for(condition: Callable[[], T], timeout_s: float = 15.0, interval_s: float = 0.05,
             message: str = "condition") -> T:
    """Poll ``condition`` until it returns a truthy value and return it; raise ``TimeoutError``
    after ``timeout_s`` seconds (naming ``message`` and the condition's last exception)."""
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
    """Start a command with the current environment plus ``env``; its combined output goes to
    a temporary file that ``stop_process`` returns."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(list(args), env=full_env, stdout=log, stderr=subprocess.STDOUT)
    proc._log = log  # type: ignore[attr-defined]
    return proc


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> str:
    """Terminate ``proc`` (SIGTERM, then SIGKILL after ``timeout_s``) and return its combined
    output ("" for a process ``start_process`` did not start)."""
    terminate(proc, timeout_s)
    log = getattr(proc, "_log", None)
    if log is None:
        return ""
    log.seek(0)
    out: bytes = log.read()
    log.close()
    return out.decode(errors="replace")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
