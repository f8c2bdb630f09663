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

from loadtest.harness.processes import output
from tests.helpers import PYTHON, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import Router

pytestmark = pytest.mark.timeout(90)

# signal to exit, generous for a busy machine: the stop line (``stopped_line``) is what tells an
# interrupted wait from one waited out (the engine wait alone was 10 s, the Redis one endless)
STOP_WITHIN_S = 20.0
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


def assert_stops(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> str:
    """Send ``sig`` to ``proc``; it must exit 0 within ``STOP_WITHIN_S``. Returns its output."""
    proc.send_signal(sig)
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


def test_an_unreachable_redis_is_one_line_per_interval_and_ctrl_c_ends_the_wait(
        tmp_path: Path) -> None:
    """The router logs an unreachable Redis (it was silent: only /ready said so) and the worker
    stops logging each retry (0.1 s doubling: 4-5 lines in the first 3 s): one line each per
    10 s. SIGINT ends both start-up waits as SIGTERM does."""
    redis_url = f"redis://127.0.0.1:{closed_port()}/0"
    worker = start_process([PYTHON, "-m", "worker.cli", "report", "--engine-url",
                            f"http://127.0.0.1:{closed_port()}", "--redis-url", redis_url,
                            "--replica-id", "r0", "--kv-events-endpoint", "tcp://127.0.0.1:9",
                            "--metrics-port", "0"])
    router = Router(tmp_path, ["--redis-url", redis_url])
    try:
        wait_for(lambda: "Redis not reachable yet" in output(worker), 30, procs=[worker],
                 message="the worker's line")
        wait_for(lambda: "redis not reachable" in output(router.proc), 30,
                 procs=[router.proc], message="the router's line")
        time.sleep(4.0)  # retries at 0.1, 0.2, 0.4, 0.8, 1.6 s ... meanwhile: no second line
        assert output(worker).count("Redis not reachable yet") == 1, output(worker)
        assert output(router.proc).count("redis not reachable") == 1, output(router.proc)
        assert "waiting for Redis" in assert_stops(worker, signal.SIGINT)
        assert_stops(router.proc, signal.SIGINT)
    finally:
        stop_process(worker)
        router.stop()
