"""OpenTelemetry traces of requests through the router. An optional edge: it imports the
OpenTelemetry SDK only when tracing is on (``otlp_traces_endpoint``; install
``prefix-router[tracing]``), and does I/O only through the exporter it is given.

Per request: a server span (``POST /v1/completions``; parent: the client's W3C
``traceparent``, when sent), with children ``tokenize_hash`` (prompt -> token ids -> block-key
chain), ``route`` (policy decision) and one ``upstream`` client span per attempt, whose context
goes to the replica in a fresh ``traceparent`` header (W3C Trace Context, which vLLM reads when
started with ``--otlp-traces-endpoint``), so the engine's own spans join the same trace.
Off (the default), every method is a no-op and no header is touched: a client's own
``traceparent`` then passes through to the engine unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any, Final

from router.shared.version import version

SERVICE_NAME: Final = "prefix-router"
TRACEPARENT: Final = "traceparent"  # W3C Trace Context header


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but the OpenTelemetry SDK or OTLP exporter is not installed."""


class Tracing:
    """Spans of one router process from ``provider`` (an OpenTelemetry SDK ``TracerProvider``),
    or nothing when ``provider`` is None. Spans nest through the asyncio task's context."""

    def __init__(self, provider: Any | None = None) -> None:
        self.provider = provider
        self.enabled = provider is not None
        if provider is not None:
            from opentelemetry import trace
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._trace = trace
            self._tracer = provider.get_tracer("router", version())
            self._propagator = TraceContextTextMapPropagator()

    @contextlib.contextmanager
    def server_span(self, name: str, headers: Mapping[str, str],
                    attributes: Mapping[str, Any]) -> Iterator[Any]:
        """A SERVER span for one HTTP request, child of the client's ``traceparent`` if any;
        yields the span (None when off)."""
        if not self.enabled:
            yield None
            return
        parent = self._propagator.extract({k.lower(): v for k, v in headers.items()})
        with self._tracer.start_as_current_span(name, context=parent,
                                                kind=self._trace.SpanKind.SERVER,
                                                attributes=dict(attributes)) as span:
            yield span

    @contextlib.contextmanager
    def span(self, name: str, attributes: Mapping[str, Any] | None = None) -> Iterator[Any]:
        """An INTERNAL child span of the current one; yields it (None when off)."""
        if not self.enabled:
            yield None
            return
        with self._tracer.start_as_current_span(name, attributes=dict(attributes or {})) as span:
            yield span

    @contextlib.contextmanager
    def client_span(self, name: str, headers: MutableMapping[str, str],
                    attributes: Mapping[str, Any]) -> Iterator[Any]:
        """A CLIENT span for one upstream attempt; sets ``headers``' ``traceparent`` (and
        ``tracestate``) to it. Yields the span (None when off; ``headers`` untouched)."""
        if not self.enabled:
            yield None
            return
        with self._tracer.start_as_current_span(name, kind=self._trace.SpanKind.CLIENT,
                                                attributes=dict(attributes)) as span:
            self._propagator.inject(headers)
            yield span

    def shutdown(self) -> None:
        """Flush and stop the exporter (at router shutdown)."""
        if self.provider is not None:
            self.provider.shutdown()


def otlp_tracing(endpoint: str | None) -> Tracing:
    """``Tracing`` exporting over OTLP/HTTP to ``endpoint`` in batches (off when None).
    Raises ``TracingUnavailable`` when the OpenTelemetry packages are missing."""
    if endpoint is None:
        return Tracing(None)
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(
            "otlp_traces_endpoint is set but OpenTelemetry is not installed: "
            "pip install 'prefix-router[tracing]'") from exc
    provider = TracerProvider(resource=Resource.create(
        {"service.name": SERVICE_NAME, "service.version": version()}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return Tracing(provider)
