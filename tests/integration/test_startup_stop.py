"""A stop signal during start-up ends the process at once: the worker waiting for Redis, for an
engine that does not answer, or for the engine's KV event sources, and the router waiting for
Redis, each exit 0 within a few seconds of SIGTERM (a Kubernetes pod is not left to SIGKILL).

Real worker and router processes; a closed port stands for an unreachable Redis, and a
listening socket that never accepts for an engine that does not answer.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.harness import output
from tests.helpers import PYTHON, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import Router

pytestmark = pytest.mark.timeout(90)

# SIGTERM to exit; the worker's engine wait alone was 10 s before the fix: a bound just under
# that tells the two apart without timing a busy machine's shutdown (a prompt stop takes well
# under 1 s on a quiet one)
STOP_WITHIN_S = 8.0
STOPPED_LINE = "stop signal during start-up"


def closed_port() -> int:
    """A loopback port nothing listens on (bound once, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@contextlib.contextmanager
def silent_engine() -> Iterator[str]:
    """The URL of a listener that never accepts: connections open (the backlog), requests hang."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def assert_stops(proc: subprocess.Popen[bytes]) -> str:
    """SIGTERM ``proc``; it must exit 0 within ``STOP_WITHIN_S``. Returns its output."""
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    try:
        rc = proc.wait(STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        out = stop_process(proc)
        raise AssertionError(f"still running {STOP_WITHIN_S} s after SIGTERM:\n{out}") from None
    out = stop_process(proc)
    assert rc == 0, out
    assert time.monotonic() - started < STOP_WITHIN_S
    return out


def stopped_line(engine_url: str, redis_url: str, events: str, waiting: str) -> str:
    """Start a worker, wait for its log line ``waiting`` (the signal handlers are set by then),
    stop it (``assert_stops``) and return its one stop line."""
    proc = start_process([PYTHON, "-m", "worker.cli", "report", "--engine-url", engine_url,
                          "--redis-url", redis_url, "--replica-id", "r0",
                          "--kv-events-endpoint", events, "--metrics-port", "0"])
    try:
        wait_for(lambda: waiting in output(proc), 30, message=waiting, procs=[proc])
        out = assert_stops(proc)
    finally:
        stop_process(proc)
    lines = [line for line in out.splitlines() if STOPPED_LINE in line]
    assert len(lines) == 1, out
    return lines[0]


def test_worker_stops_while_redis_is_unreachable() -> None:
    line = stopped_line(f"http://127.0.0.1:{closed_port()}", f"redis://127.0.0.1:{closed_port()}/0",
                        "tcp://127.0.0.1:9", "Redis not reachable yet")
    assert "waiting for Redis" in line


def test_worker_stops_while_the_engine_does_not_answer(redis_url: str) -> None:
    with silent_engine() as engine:  # past the Redis read, waiting for the engine's config
        line = stopped_line(engine, redis_url, "tcp://127.0.0.1:9", "no previous state")
    assert "waiting for the engine's cache config" in line


def test_worker_stops_while_discovering_kv_event_sources(redis_url: str) -> None:
    with silent_engine() as engine:
        line = stopped_line(engine, redis_url, "auto", "not known yet")
    assert "waiting for the engine's KV event sources" in line


def test_router_stops_while_redis_is_unreachable(tmp_path: Path) -> None:
    router = Router(tmp_path, ["--redis-url", f"redis://127.0.0.1:{closed_port()}/0"])
    try:
        assert router.ready()["redis"]["connected"] is False
        assert_stops(router.proc)
    finally:
        router.stop()
