"""Helpers for integration tests: the shared harness (``loadtest.harness``: real processes on
loopback, waits on conditions) and a fake replica script."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadtest.harness import (
    EMULATE,
    PYTHON,
    free_port,
    start_emulator,
    start_process,
    stop_process,
    wait_for,
    wait_ready,
)

__all__ = ["EMULATE", "PYTHON", "free_port", "start_emulator", "start_process", "stop_process",
           "wait_for", "wait_ready", "wait_routable"]


def wait_routable(router: Any, count: int, procs: Sequence[Any] = ()) -> None:
    """Wait until ``count`` replicas are routable with prefix affinity on ``router``'s
    ``/ready`` (``router.ready()``); raises ``ProcessExited`` at once, with its output, when one
    of ``procs`` (the workers, say) exits first."""
    wait_for(lambda: sum(r["routable"] and r["affinity"] for r in router.ready()["replicas"])
             == count, 30, message=f"{count} replicas routable with affinity", procs=procs)


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
