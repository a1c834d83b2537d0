"""The request's root span, first of all, when tracing is on: continues the client's own
``traceparent`` and ends with the response (a stream's last byte, or the client leaving).

Everything later in the pipeline runs inside it, so the stage spans, the dispatch span, the
trace context sent to the replica and the ``traceparent`` sent to the fallback are its children.
Attributes are what an operator filters on; never prompt or completion text, never a key.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer
from starlette.responses import Response

from serve_app.pipeline import Handler, RequestContext, on_response_end
from serve_app.tracing import describe_usage, extract


class TraceStage:
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        span = self.tracer.start_span(
            "forge.request",
            context=extract(ctx.request.headers),
            kind=SpanKind.SERVER,
            attributes={"forge.route": ctx.route_label, "http.request.method": ctx.request.method},
        )
        try:
            # Not the exception itself: its message may quote the request (forge.error is
            # its type).
            with trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                response = await call_next(ctx)
        except BaseException as exc:
            span.set_attribute("forge.error", type(exc).__name__)
            _describe(span, ctx)
            span.end()
            raise

        def finish(completed: bool) -> None:
            _describe(span, ctx)
            span.set_attribute("http.response.status_code", response.status_code)
            span.set_attribute("forge.completed", completed)
            if ctx.stream_error:
                span.set_attribute("forge.truncated", True)
            span.end()

        return on_response_end(response, finish)


def _describe(span: trace.Span, ctx: RequestContext) -> None:
    span.set_attribute("forge.request_id", ctx.request_id)
    span.set_attribute("forge.tenant", ctx.tenant_name)
    span.set_attribute("forge.model", ctx.model_name)
    span.set_attribute("forge.backend", ctx.backend)
    if ctx.replica:
        span.set_attribute("forge.replica", ctx.replica)
    if ctx.first_byte_at is not None:
        span.set_attribute("forge.ttft_ms", round((ctx.first_byte_at - ctx.started) * 1000, 2))
    describe_usage(span, ctx.usage)
