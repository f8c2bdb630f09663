"""The stream-idle timeout of a relayed response: a replica that goes silent mid-stream longer
than ``--stream-idle-timeout-s`` ends the client's stream with an SSE error event (504), while a
stream whose chunks come more often than that runs on however long it lasts in all.

A real router process on port 0 in front of a real aiohttp upstream process that paces or
stalls its server-sent events (chosen by the prompt's first token).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import FAKE_REPLICA_TAIL
from tests.integration.test_router_fleet import Router, prometheus_value, scripted_replica

pytestmark = pytest.mark.timeout(90)

IDLE_S = 0.6
PACED_SSE_SERVER = """
import asyncio, json, sys
from aiohttp import web
async def completions(request):
    prompt = json.loads(await request.read())["prompt"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if prompt[0] == 1:  # paced: 10 events 0.2 s apart (2 s in all, gaps well under the timeout)
        for i in range(10):
            await resp.write(b'data: {"i": %d}\\n\\n' % i)
            await asyncio.sleep(0.2)
    else:  # three events 0.4 s apart, then silence
        for i in range(3):
            await resp.write(b'data: {"i": %d}\\n\\n' % i)
            await asyncio.sleep(0.4 if i < 2 else 30)
    await resp.write(b"data: [DONE]\\n\\n")
    await resp.write_eof()
    return resp""" + FAKE_REPLICA_TAIL


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[Router]:
    with scripted_replica(PACED_SSE_SERVER) as url:
        router = Router(tmp_path, ["--replica", url, "--stream-idle-timeout-s", str(IDLE_S)])
        try:
            yield router
        finally:
            router.stop()


def test_a_stream_with_short_gaps_outlives_the_idle_timeout(relay: Router) -> None:
    started = time.monotonic()
    status, _, body = relay.post("/v1/completions", {"model": "fixed", "prompt": [1], "stream": True})
    assert status == 200 and time.monotonic() - started > 3 * IDLE_S
    assert body == b"".join(b'data: {"i": %d}\n\n' % i for i in range(10)) + b"data: [DONE]\n\n"
    assert prometheus_value(relay.metrics(), "router_upstream_errors_total") == 0


def test_a_replica_silent_mid_stream_gets_an_sse_error_after_the_idle_timeout(relay: Router) -> None:
    started = time.monotonic()
    status, _, body = relay.post("/v1/completions", {"model": "fixed", "prompt": [2], "stream": True})
    elapsed = time.monotonic() - started
    # cut by the idle timeout (the replica's silence would end at 30.8 s; the error event below
    # names the timeout): an upper bound nearer IDLE_S would time the machine
    assert status == 200 and 0.8 + IDLE_S <= elapsed < 30, elapsed
    *events, error = body.split(b"\n\n")[:4]
    assert events == [b'data: {"i": %d}' % i for i in range(3)]
    payload = json.loads(error.removeprefix(b"data: "))["error"]
    assert payload["type"] == "GatewayTimeoutError" and payload["code"] == 504
    assert "stream_idle_timeout" in payload["message"]
    assert 'router_upstream_errors_total{kind="stream_idle_timeout",replica=' in relay.metrics()
    # the router still serves
    status, _, _ = relay.post("/v1/completions", {"model": "fixed", "prompt": [1], "stream": True})
    assert status == 200
