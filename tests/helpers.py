"""Helpers for integration tests: the shared harness (``loadtest.harness.processes``: real processes on
loopback, waits on conditions) and a fake replica script."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from loadtest.harness.processes import (
    EMULATE,
    PYTHON,
    free_port,
    free_port_run,
    start_emulator,
    start_process,
    stop_process,
    wait_for,
    wait_ready,
)

__all__ = ["EMULATE", "PYTHON", "ReplicaFeed", "emulator_url", "free_port", "free_port_run",
           "start_emulator", "start_process", "start_script_replica", "stop_all", "stop_process",
           "stopping", "wait_for", "wait_ready", "wait_routable"]


class _HasStop(Protocol):
    def stop(self) -> Any: ...


_Stoppable = TypeVar("_Stoppable", bound=_HasStop)


class ReplicaFeed:
    """Writes one made-up replica's worker reports into a real Redis (redis-py ``client``,
    prefix ``pr``): its heartbeat (no engine behind its URL) and version-1 stream entries."""

    def __init__(self, client: Any, replica_id: str = "replica-x") -> None:
        self.client = client
        self.replica_id = replica_id

    def heartbeat(self) -> None:
        from router.shared import contract as c

        self.client.hset(c.replica_key("pr", self.replica_id), mapping={
            c.F_URL: "http://127.0.0.1:9", c.F_MODELS: '["m"]', c.F_BLOCK_SIZE: "16",
            c.F_HASH_ALGO: "sha256", c.F_HASH_VERIFIED: "1", c.F_EPOCH: "1",
            c.F_HEARTBEAT_TS: str(time.time())})

    def stored(self, keys: list[int], pipe: Any = None) -> None:
        """One entry storing ``keys`` (on ``pipe`` when given, else at once)."""
        from router.shared import contract as c

        (pipe or self.client).xadd(c.events_key("pr"), {
            c.E_REPLICA: self.replica_id, c.E_EPOCH: "1", c.E_OP: c.OP_STORED,
            c.E_KEYS: c.pack_keys(keys)})


def wait_routable(router: Any, count: int, procs: Sequence[Any] = ()) -> None:
    """Wait until ``count`` replicas are routable with prefix affinity on ``router``'s
    ``/ready`` (``router.ready()``); raises ``ProcessExited`` at once, with its output, when one
    of ``procs`` (the workers, say) exits first."""
    wait_for(lambda: sum(r["routable"] and r["affinity"] for r in router.ready()["replicas"])
             == count, 30, message=f"{count} replicas routable with affinity", procs=procs)


@contextlib.contextmanager
def stopping(owner: _Stoppable) -> Iterator[_Stoppable]:
    """``owner`` (a ``Router``, a fleet: anything with ``stop()``), stopped when the block ends,
    as ``contextlib.closing`` closes."""
    try:
        yield owner
    finally:
        owner.stop()


def stop_all(router: Any, *procs: subprocess.Popen[bytes]) -> None:
    """The end of a test: stop its router (a ``Router``; None when it did not start), then
    ``procs`` in order."""
    if router is not None:
        router.stop()
    for proc in procs:
        stop_process(proc)


@contextlib.contextmanager
def emulator_url(ready_file: Path, *args: str, timeout_s: float = 60.0) -> Iterator[str]:
    """The URL of the first replica of an emulator started with ``args`` (``start_emulator``,
    writing ``ready_file``), stopped when the block ends."""
    proc, replicas = start_emulator(ready_file, args, timeout_s=timeout_s)
    try:
        yield replicas[0]["url"]
    finally:
        stop_process(proc)


def start_script_replica(source: str, *args: str, env: Mapping[str, str] | None = None,
                         name: str = "script replica") -> tuple[subprocess.Popen[bytes], int]:
    """Run a fake replica script ``source`` (its ``completions`` handler, then
    ``FAKE_REPLICA_TAIL``) on a free loopback port, ``args`` after the port: ``(process, port)``
    once its ``/health`` answers 200. When it does not start, it is stopped and
    ``ProcessExited`` or ``TimeoutError`` (with its output) raised."""
    port = free_port()
    proc = start_process([PYTHON, "-c", source, str(port), *args], env)

    def healthy() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return bool(resp.status == 200)

    try:
        wait_for(healthy, 30, message=f"{name} up", procs=[proc])
    except BaseException:
        stop_process(proc)
        raise
    return proc, port


# the rest of a fake replica script after its ``completions`` handler (health, models, serving);
# ``/health`` answers 503 while the file named by FAKE_REPLICA_DOWN_FLAG (if set) exists
FAKE_REPLICA_TAIL = """
import os
async def health(request):
    down = os.environ.get("FAKE_REPLICA_DOWN_FLAG")
    return web.json_response({}, status=503 if down and os.path.exists(down) else 200)
async def models(request):
    return web.json_response({"object": "list", "data": [{"id": "fixed", "object": "model"}]})
app = web.Application()
app.router.add_post("/v1/completions", completions)
app.router.add_get("/health", health)
app.router.add_get("/v1/models", models)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None)
"""
