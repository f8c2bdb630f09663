"""OpenTelemetry traces through the router, against real replicas on loopback.

The router runs in the test process (so its spans go to an in-memory exporter) in front of a
real emulator process and of a replica that records the headers it receives. Checked: the
spans tokenize_hash, route and upstream are children of the request's server span, which
continues the client's W3C trace; the replica receives a ``traceparent`` naming the upstream
span; with tracing off the client's header passes unchanged; ``--otlp-traces-endpoint`` exports
OTLP/HTTP protobuf to a real receiver; and the router runs without OpenTelemetry installed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from router.observability.tracing import Tracing
from router.service.config import load_config
from router.service.server import RouterService
from tests.helpers import emulator_url
from tests.integration.test_router_fleet import Router

otel_sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with emulator_url(tmp_path_factory.mktemp("emu") / "emu.json", "--time-scale", "50") as url:
        yield url


class RecordingReplica:
    """A replica that answers completions and records the request headers it got."""

    def __init__(self) -> None:
        self.headers: list[dict[str, str]] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        async def completions(request: web.Request) -> web.Response:
            self.headers.append({k.lower(): v for k, v in request.headers.items()})
            return web.json_response({"choices": [{"text": "ok", "index": 0}]})

        async def ok(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/health", ok)
        app.router.add_get("/v1/models", ok)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"


@pytest.fixture
async def recording() -> AsyncIterator[RecordingReplica]:
    replica = RecordingReplica()
    await replica.start()
    yield replica
    assert replica.runner is not None
    await replica.runner.cleanup()


async def start_router(replica_url: str, tracing: Tracing) -> tuple[web.AppRunner, str]:
    config = load_config(["--replica", replica_url, "--port", "0"], env={})
    runner = web.AppRunner(RouterService(config, None, tracing).build_app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def in_memory() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


async def post(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/completions", json={"prompt": list(range(1, 70)), "max_tokens": 2},
            headers=headers) as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


async def test_spans_of_a_request_through_a_real_emulator(emulator: str) -> None:
    tracing, exporter = in_memory()
    runner, url = await start_router(emulator, tracing)
    try:
        status, headers = await post(url, {"traceparent": CLIENT_PARENT, "x-request-id": "req-1"})
    finally:
        await runner.cleanup()
    assert status == 200
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/completions", "tokenize_hash", "route", "upstream"}
    server = spans["POST /v1/completions"]
    assert format(server.context.trace_id, "032x") == CLIENT_TRACE_ID, "continues the client's trace"
    assert format(server.parent.span_id, "016x") == "00f067aa0ba902b7"
    for name in ("tokenize_hash", "route", "upstream"):
        assert spans[name].parent.span_id == server.context.span_id, name
        assert spans[name].context.trace_id == server.context.trace_id
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["prefix_router.request_id"] == "req-1"
    assert spans["tokenize_hash"].attributes["prefix_router.num_tokens"] == 69
    assert spans["route"].attributes["prefix_router.replica"] == headers["x-prefix-router-replica"]
    assert spans["upstream"].attributes["http.response.status_code"] == 200
    # tokenize/hash, then route, then upstream, in time order
    assert (spans["tokenize_hash"].end_time <= spans["route"].start_time
            and spans["route"].end_time <= spans["upstream"].start_time)


async def test_replica_receives_the_upstream_span_as_traceparent(recording: RecordingReplica) -> None:
    tracing, exporter = in_memory()
    runner, url = await start_router(recording.url, tracing)
    try:
        assert (await post(url, {"traceparent": CLIENT_PARENT}))[0] == 200
        assert (await post(url, {}))[0] == 200  # no client trace: the router starts one
    finally:
        await runner.cleanup()
    upstream = [s for s in exporter.get_finished_spans() if s.name == "upstream"]
    assert len(upstream) == 2 and len(recording.headers) == 2
    for span, got in zip(upstream, recording.headers, strict=True):
        ctx = span.context
        assert got["traceparent"] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    assert recording.headers[0]["traceparent"].split("-")[1] == CLIENT_TRACE_ID
    assert recording.headers[1]["traceparent"].split("-")[1] != CLIENT_TRACE_ID


async def test_tracing_off_passes_the_client_traceparent_unchanged(recording: RecordingReplica) -> None:
    runner, url = await start_router(recording.url, Tracing(None))
    try:
        assert (await post(url, {"traceparent": CLIENT_PARENT}))[0] == 200
        assert (await post(url, {}))[0] == 200
    finally:
        await runner.cleanup()
    assert recording.headers[0]["traceparent"] == CLIENT_PARENT
    assert "traceparent" not in recording.headers[1]


def test_otlp_export_from_a_router_process(tmp_path: Path, emulator: str) -> None:
    """``prefix-router serve --otlp-traces-endpoint`` sends OTLP/HTTP protobuf to a real
    receiver (an aiohttp server standing in for a collector) with the request's spans."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[bytes] = []
    ready: asyncio.Future[str] | None = None

    async def receiver(stop: asyncio.Event) -> None:
        async def export(request: web.Request) -> web.Response:
            received.append(await request.read())
            return web.Response(body=b"", content_type="application/x-protobuf")

        app = web.Application()
        app.router.add_post("/v1/traces", export)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        assert ready is not None
        ready.set_result(f"http://127.0.0.1:{runner.addresses[0][1]}/v1/traces")
        await stop.wait()
        await runner.cleanup()

    async def scenario() -> None:
        nonlocal ready
        ready = asyncio.get_running_loop().create_future()
        stop = asyncio.Event()
        task = asyncio.create_task(receiver(stop))
        endpoint = await ready
        router = await asyncio.to_thread(Router, tmp_path, [
            "--replica", emulator, "--otlp-traces-endpoint", endpoint])
        try:
            status, _, _ = await asyncio.to_thread(
                router.post, "/v1/completions", {"prompt": list(range(1, 40)), "max_tokens": 1})
            assert status == 200
        finally:
            await asyncio.to_thread(router.stop)  # SIGTERM: the batch processor flushes
        stop.set()
        await task

    asyncio.run(scenario())
    names = set()
    for body in received:
        message = ExportTraceServiceRequest.FromString(body)
        for resource_spans in message.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            assert service["service.name"] == "prefix-router"
            names |= {s.name for scope in resource_spans.scope_spans for s in scope.spans}
    assert {"POST /v1/completions", "tokenize_hash", "route", "upstream"} <= names


def test_router_runs_without_opentelemetry() -> None:
    """With the opentelemetry packages unimportable the router serves (tracing off) and asking
    for tracing is one clear error."""
    script = """
import sys
for name in ("opentelemetry", "opentelemetry.sdk", "opentelemetry.trace"):
    sys.modules[name] = None  # import fails as if not installed
from router.service.config import load_config
from router.service.server import RouterService
from router.observability.tracing import TracingUnavailable, otlp_tracing
service = RouterService(load_config(["--replica", "http://127.0.0.1:9"], env={}), None)
service.build_app()
assert not service.tracing.enabled
try:
    otlp_tracing("http://127.0.0.1:4318/v1/traces")
except TracingUnavailable as exc:
    print("unavailable:", exc)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "pip install 'prefix-router[tracing]'" in result.stdout


def test_json_logs_carry_the_request_id(tmp_path: Path, emulator: str) -> None:
    router = Router(tmp_path, ["--replica", emulator, "--log-format", "json", "--log-level",
                               "debug"])
    try:
        status, _, _ = router.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1},
                                   headers={"x-request-id": "req-json-7"})
        assert status == 200
    finally:
        out = router.stop()
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert lines, out
    for line in lines:
        assert set(line) >= {"ts", "level", "logger", "message", "request_id"}
    served = [line for line in lines if line["message"].startswith("route ")]
    assert served and all(line["request_id"] == "req-json-7" for line in served)
    assert any(line["request_id"] is None for line in lines)  # start-up lines: no request
