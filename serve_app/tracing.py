"""OpenTelemetry traces: one trace per request, a span per pipeline stage, carried into the replica
and, as ``traceparent``, to the fallback.

Why Forge's own spans and not (only) Ray Serve's built-in tracing (``tracing_config``, alpha in
2.60): Serve's spans describe Serve (proxy, handle call, replica method) and know nothing of
tenants, stages, breakers or retries, which is what an operator needs from a slow request; and
they are configured per Serve instance, not per application. Forge's spans ride on the same W3C
trace context, so a cluster that also turns Serve's tracing on gets one joined trace.

Nothing is traced unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set: then spans go out over OTLP/HTTP
in batches, head-sampled at ``tracing.sample_ratio`` (a client's sampled ``traceparent`` is
honoured). Spans carry ids, names and counts, never prompt or completion text, nor a key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Tracer

from serve_app.config.models import TracingConfig

TRACER_NAME = "forge"

_providers: dict[str, object] = {}  # one provider per process and service name


def tracer_for(
    config: TracingConfig, service: str, environ: Mapping[str, str] | None = None
) -> Tracer | None:
    """This process's tracer for ``service``, or None when nothing would be exported."""
    environ = os.environ if environ is None else environ
    if not environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return None
    provider = _providers.get(service)
    if provider is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        provider = TracerProvider(
            resource=Resource.create({"service.name": service}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        _providers[service] = provider
    return provider.get_tracer(TRACER_NAME)


def carrier() -> dict[str, str] | None:
    """The current trace context as W3C headers (``traceparent``) for a call to a backend, or
    None outside a recorded trace (the common, untraced case costs one lookup)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


def describe_usage(span: trace.Span, usage: dict | None) -> None:
    """Token counts on a span: the engine's own numbers (never the text they count)."""
    for field in ("prompt_tokens", "completion_tokens"):
        value = (usage or {}).get(field)
        if isinstance(value, int):
            span.set_attribute(f"forge.{field}", value)


def extract(headers: Mapping[str, str] | None) -> Context | None:
    """The context a caller sent (a client's headers, or a gateway's ``carrier()``)."""
    return propagate.extract(headers) if headers else None
