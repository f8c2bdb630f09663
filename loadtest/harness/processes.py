"""Start real processes (emulators, workers, routers, helpers) on loopback and wait on
conditions: the one harness of the tests and the benchmarks. Does process I/O.

A started process writes its combined output to a temporary file (a pipe nobody reads would
block a chatty server); ``stop_process`` stops it (SIGTERM, then SIGKILL) and returns that
output, so a failing test or benchmark can show it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

from loadtest.harness.redis_server import free_port

__all__ = ["EMULATE", "PYTHON", "ProcessExited", "cpu_seconds", "describe", "free_port",
           "free_port_run", "output", "output_hint", "start_emulator", "start_process",
           "stop_process", "stop_processes", "wait_for", "wait_ready"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
PYTHON = sys.executable
# ``prefix-worker emulate`` on loopback, port 0 (replica i on an ephemeral port): the emulator's
# command line, followed by the caller's own flags (a later flag overrides, e.g. ``--port``).
EMULATE = [PYTHON, "-m", "worker.cli", "emulate", "--host", "127.0.0.1", "--port", "0"]


class ProcessExited(RuntimeError):
    """A process that a wait watched exited first (the message names it, its status and the
    tail of its output)."""


def wait_for(condition: Callable[[], T], timeout_s: float = 15.0, interval_s: float = 0.05,
             message: str = "condition", procs: Sequence[subprocess.Popen[bytes]] = ()) -> T:
    """Poll ``condition`` until it returns a truthy value and return it; raise ``TimeoutError``
    after ``timeout_s`` seconds (naming ``message`` and the condition's last exception), or
    ``ProcessExited`` as soon as one of ``procs`` (the processes the condition waits on) has
    exited."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise ProcessExited(f"{describe(proc)} exited with status {proc.returncode} "
                                    f"while waiting for {message}{output_hint(proc)}")
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # the condition may fail while a server starts
            last_exc = exc
        time.sleep(interval_s)
    hints = "".join(output_hint(p) for p in procs)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {message}; "
                       f"last error: {last_exc!r}{hints}")


def wait_ready(path: Path, procs: Sequence[subprocess.Popen[bytes]] = (), timeout_s: float = 90.0,
               message: str | None = None) -> Any:
    """The JSON a process wrote to its ready file ``path`` (``--ready-file``: the emulator, the
    router, the fault proxy), once it is there; raises like ``wait_for``."""
    return wait_for(lambda: json.loads(path.read_text()), timeout_s, 0.05,
                    message or f"ready file {path}", procs)


def start_process(args: Sequence[str], env: Mapping[str, str] | None = None,
                  log_path: Path | None = None, **popen: Any) -> subprocess.Popen[bytes]:
    """Start a command with the current environment plus ``env``; its combined output goes to
    ``log_path`` (kept) or a temporary file, which ``stop_process`` returns. ``popen`` holds
    further ``subprocess.Popen`` keywords (``start_new_session``, ``preexec_fn``, ``stdin``)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    log: IO[bytes] = log_path.open("w+b") if log_path is not None else tempfile.TemporaryFile()
    proc = subprocess.Popen(list(args), env=full_env, stdout=log, stderr=subprocess.STDOUT,
                            **popen)
    proc._log = log  # type: ignore[attr-defined]
    proc._log_path = log_path  # type: ignore[attr-defined]
    return proc


def start_emulator(ready_file: Path, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                   log_path: Path | None = None, timeout_s: float = 180.0,
                   ) -> tuple[subprocess.Popen[bytes], list[dict[str, Any]]]:
    """Start ``prefix-worker emulate`` (``EMULATE`` plus ``args``, writing ``ready_file``) and
    wait until it serves: ``(process, replicas)``, each replica as its ready file lists it
    (``index``, ``url``, ``kv_events_endpoint``, ``kv_replay_endpoint``). When it does not
    start, it is stopped and ``ProcessExited`` or ``TimeoutError`` (with its output) raised."""
    proc = start_process([*EMULATE, *args, "--ready-file", str(ready_file)], env, log_path)
    try:
        data = wait_ready(ready_file, [proc], timeout_s, "the emulator's ready file")
    except BaseException:
        stop_process(proc)
        raise
    replicas: list[dict[str, Any]] = data["replicas"]
    return proc, replicas


def describe(proc: subprocess.Popen[bytes]) -> str:
    """A short name of ``proc``: its command's module or program, and its pid."""
    args = [str(a) for a in proc.args] if isinstance(proc.args, (list, tuple)) else [str(proc.args)]
    name = args[2] if len(args) > 2 and args[1] == "-m" else Path(args[0]).name
    return f"{name} (pid {proc.pid})"


def output(proc: subprocess.Popen[bytes]) -> str:
    """What ``proc`` (started by ``start_process``) has written so far; "" otherwise."""
    log = getattr(proc, "_log", None)
    if log is None or log.closed:
        path = getattr(proc, "_log_path", None)
        return path.read_text(errors="replace") if path is not None and path.exists() else ""
    log.flush()
    position = log.tell()
    log.seek(0)
    out: bytes = log.read()
    log.seek(position)
    return out.decode(errors="replace")


def output_hint(proc: subprocess.Popen[bytes], chars: int = 2000) -> str:
    """The tail of ``proc``'s output, with its log file, for an error message."""
    tail = output(proc)[-chars:]
    path = getattr(proc, "_log_path", None)
    where = f" (log {path})" if path is not None else ""
    return f"\n--- {describe(proc)}{where}:\n{tail}" if tail or where else ""


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> str:
    """Terminate ``proc`` (SIGTERM, then SIGKILL after ``timeout_s``) and return its combined
    output ("" for a process ``start_process`` did not start)."""
    stop_processes([proc], timeout_s, keep_output=True)
    out = output(proc)
    _close_log(proc)
    return out


def _close_log(proc: subprocess.Popen[bytes]) -> None:
    log = getattr(proc, "_log", None)
    if log is not None:
        with contextlib.suppress(OSError):
            log.close()


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 10.0,
                   keep_output: bool = False) -> None:
    """Stop ``procs`` newest first, all at once: SIGTERM to every one still running, then wait
    up to ``timeout_s`` seconds in all, SIGKILL for any still running; then close their output
    files unless ``keep_output``. Never raises."""
    for proc in reversed(procs):
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in reversed(procs):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s; killing it", describe(proc), timeout_s)
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if not keep_output:
            _close_log(proc)


def _ephemeral_low(default: int = 32768) -> int:
    """The first port of the kernel's ephemeral range (Linux ``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def free_port_run(count: int, rng: random.Random | None = None) -> int:
    """A port ``base`` such that ``base`` .. ``base + count - 1`` were all free a moment ago on
    every interface (a data-parallel engine binds ``tcp://*:P`` and rank r at P + r).

    The run is drawn below the kernel's ephemeral range: ports there are never handed to the
    client sockets other tests open meanwhile, which is what took ``free_port() + 1`` from an
    engine's rank 1 about one run in three. Raises ``RuntimeError`` after 100 tries."""
    rng = rng or random.Random()
    high = min(_ephemeral_low(), 65536) - count
    for _ in range(100):
        base = rng.randrange(10000, high) if high > 10000 else free_port()
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sockets.append(socket.socket())
                sockets[-1].bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used (Linux ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
