"""Helpers for integration tests: the shared harness (``loadtest.harness``: real processes on
loopback, waits on conditions) and a fake replica script."""

from __future__ import annotations

from loadtest.harness import EMULATE, PYTHON, free_port, start_process, stop_process, wait_for

__all__ = ["EMULATE", "PYTHON", "free_port", "start_process", "stop_process", "wait_for"]


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
