"""A password-protected Redis (``requirepass`` fed on the server's stdin, as the chart does):
router and worker read the password from a file, and it appears on no process's command line.

Real processes on loopback: redis-server, one emulated replica, its worker, the router.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from loadtest.harness.redis_server import RedisServer
from tests.helpers import EMULATE, PYTHON, start_process, stop_process, wait_for
from tests.integration.test_router_fleet import KV_EVENTS, Router, read_json_file

pytestmark = pytest.mark.timeout(120)

PASSWORD = "pw-7f3c2a9e"


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_router_and_worker_authenticate_from_password_files(tmp_path: Path) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text(PASSWORD + "\n")
    procs: list[Any] = []
    router = None
    with RedisServer(password=PASSWORD) as server:
        with pytest.raises(redis.AuthenticationError):  # the server really wants the password
            redis.Redis.from_url(server.url).ping()
        try:
            ready = tmp_path / "emu.json"
            procs.append(start_process([
                *EMULATE, "--kv-events-config", KV_EVENTS, "--time-scale", "50", "--ready-file", str(ready)],
                env={"PYTHONHASHSEED": "0"}))
            rep = wait_for(lambda: read_json_file(ready), 60)["replicas"][0]
            worker = start_process([
                PYTHON, "-m", "worker.cli", "report", "--engine-url", rep["url"],
                "--kv-events-endpoint", rep["kv_events_endpoint"], "--redis-url", server.url,
                "--replica-id", "replica-0", "--hash-seed", "0", "--metrics-port", "0"],
                env={"WORKER_REDIS_PASSWORD_FILE": str(secret)})
            procs.append(worker)
            router = Router(tmp_path, ["--redis-url", server.url, "--hash-seed", "0",
                                       "--redis-password-file", str(secret)])
            wait_for(lambda: router is not None and any(
                r["routable"] for r in router.ready()["replicas"]), 30, message="replica routable")
            ready_view = router.ready()
            assert ready_view["redis"]["connected"] is True
            status, headers, _ = router.post("/v1/completions",
                                             {"prompt": list(range(1, 40)), "max_tokens": 1})
            assert status == 200 and headers["x-prefix-router-replica"] == "replica-0"
            for proc in (worker, router.proc):
                assert PASSWORD not in cmdline(proc.pid)
            assert PASSWORD not in cmdline(server._proc.pid)  # type: ignore[union-attr]
        finally:
            out = router.stop() if router is not None else ""
            out += "".join(stop_process(p) for p in reversed(procs))
    assert PASSWORD not in out, "the password was logged"
