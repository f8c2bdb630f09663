"""The one harness (``loadtest.harness.processes``) that tests, benchmarks, the fault lab and the compare
fleet start real processes with: waits fail fast when a watched process dies, ready files are
read once complete, and stopping escalates to SIGKILL."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.harness.processes import (
    PYTHON,
    ProcessExited,
    output,
    start_process,
    stop_process,
    wait_for,
    wait_ready,
)


def test_a_wait_fails_fast_with_the_dead_process_output() -> None:
    proc = start_process([PYTHON, "-c", "print('no such model', flush=True); raise SystemExit(3)"])
    try:
        # ProcessExited, not the TimeoutError the 30 s wait would end in: it did not wait out
        with pytest.raises(ProcessExited, match=r"exited with status 3 while waiting for it"
                                                r"(.|\n)*no such model"):
            wait_for(lambda: False, 30, message="it", procs=[proc])
    finally:
        stop_process(proc)


def test_wait_ready_reads_a_complete_ready_file(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    script = (f"import time, pathlib; p = pathlib.Path({str(ready)!r}); p.write_text('{{\"url\"');"
              "time.sleep(0.5); p.write_text('{\"url\": \"http://127.0.0.1:1\"}'); "
              "print('serving', flush=True); time.sleep(60)")
    proc = start_process([PYTHON, "-c", script], log_path=tmp_path / "proc.log")
    try:
        assert wait_ready(ready, [proc], 30) == {"url": "http://127.0.0.1:1"}
        wait_for(lambda: "serving" in output(proc), 30)
    finally:
        out = stop_process(proc)
    assert proc.returncode is not None and "serving" in out
    assert "serving" in (tmp_path / "proc.log").read_text()  # a named log is kept


def test_stopping_escalates_to_sigkill() -> None:
    script = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "print('up', flush=True); time.sleep(60)")
    proc = start_process([PYTHON, "-c", script])
    wait_for(lambda: "up" in output(proc), 30)
    out = stop_process(proc, timeout_s=1.0)
    # killed (-9), not the 60 s sleep's natural exit (0): the escalation happened
    assert proc.returncode == -9 and "up" in out



@pytest.mark.parametrize("start", [
    "RedisServer().__enter__().pid",
    "' '.join(str(p.pid) for p in RedisClusterServers(3).__enter__()._procs.procs.values())",
], ids=["redis", "cluster"])
def test_a_killed_owner_leaves_no_redis_behind(tmp_path: Path, start: str) -> None:
    """A benchmark killed with SIGKILL (no ``finally`` runs) used to leave its throwaway
    ``redis-server`` (or a cluster's three) running; the harness now has the kernel end them
    with their owner."""
    script = ("import time\nfrom loadtest.harness.redis_server import RedisServer\n"
              "from loadtest.harness.redis_topology import RedisClusterServers\n"
              f"print({start}, flush=True)\ntime.sleep(120)")
    log = tmp_path / "owner.log"
    owner = start_process([PYTHON, "-c", script], log_path=log)
    try:
        pids = [int(p) for p in wait_for(lambda: log.read_text().split("\n", 1)[0].split()
                                          if log.read_text().endswith("\n") else None, 120,
                                          message="the Redis pids", procs=[owner])]
        assert pids and all(_alive(pid) for pid in pids)
        owner.kill()
        owner.wait()
        wait_for(lambda: not any(_alive(pid) for pid in pids), 30,
                 message=f"Redis {pids} gone")
    finally:
        stop_process(owner)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
