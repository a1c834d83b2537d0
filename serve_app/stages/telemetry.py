"""Every outcome, observed once: OpenAI-shaped error responses, metrics, one access log line.

It sits right after the request id so it sees every request, 401s included. A streaming
response is recorded when its last byte is sent (or the client leaves), not when it starts.
"""

from __future__ import annotations

import logging
import time

import orjson
from starlette.responses import Response

from serve_app import errors
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import Handler, RequestContext, final_status, on_response_end
from serve_app.traffic.watch import TrafficWatch

logger = logging.getLogger("ray.serve")
# A child of Serve's logger: lands in the replica's log file, tagged with the request id.
access_log = logging.getLogger("ray.serve.forge.access")


class TelemetryStage:
    def __init__(self, metrics: ForgeMetrics, watch: TrafficWatch | None = None) -> None:
        self.metrics = metrics
        self.watch = watch  # per-variant windows of models: entries (``traffic/watch.py``)

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        try:
            response = await call_next(ctx)
        except errors.ForgeError as err:
            response = errors.error_response(err)
        except Exception:
            # The trace stays in our log under the request id; the client gets a clean 500.
            logger.exception("unhandled error in request %s", ctx.request_id)
            response = errors.error_response(errors.internal_error())
        return on_response_end(
            response, lambda completed: self._record(ctx, final_status(ctx, response, completed))
        )

    def _record(self, ctx: RequestContext, status: int) -> None:
        now = time.perf_counter()
        ttft = ctx.first_byte_at - ctx.started if ctx.first_byte_at else None
        duration = now - ctx.started
        model = ctx.model_label
        self.metrics.record(
            tenant=ctx.tenant_name,
            route=ctx.route_label,
            model=model,
            backend=ctx.backend,
            status=status,
            ttft_s=ttft,
            duration_s=duration,
            usage=ctx.usage,
            streamed=bool(getattr(ctx.parsed, "stream", False)),
        )
        if ctx.target is not None and ctx.target.variant is not None:
            self._record_variant(ctx, status, ttft, duration)
        if access_log.isEnabledFor(logging.INFO):
            usage = ctx.usage or {}
            access_log.info(
                orjson.dumps(
                    {
                        "request_id": ctx.request_id,
                        # Forge's own id: what the replicas and the fallback were sent.
                        "forge_id": ctx.key,
                        "tenant": ctx.tenant_name,
                        "route": ctx.route_label,
                        "model": model,
                        "backend": ctx.backend,
                        "replica": ctx.replica,
                        "status": status,
                        "latency_ms": round(duration * 1000, 2),
                        "ttft_ms": round(ttft * 1000, 2) if ttft is not None else None,
                        "prompt_tokens": usage.get("prompt_tokens"),
                        "completion_tokens": usage.get("completion_tokens"),
                        "error": ctx.stream_error,
                        "variant": ctx.target.variant if ctx.target is not None else None,
                        "adapter": ctx.adapter,  # a bound tenant's too (it asked the model)
                    }
                ).decode()
            )

    def _record_variant(
        self, ctx: RequestContext, status: int, ttft: float | None, duration: float
    ) -> None:
        """A models: entry's request, under its variant: failed if it was a 5xx or the
        variant's own pool failed it before another step served it; timed only when that
        pool answered (a spill's or a cache hit's timing is not the variant's)."""
        target = ctx.target
        own = target.steps[0].backend
        failed = status >= 500 or ctx.first_failure == own
        answered = ctx.backend == own and not failed
        completion = (ctx.usage or {}).get("completion_tokens") or 0
        tpot = None
        if answered and ttft is not None and ctx.parsed.stream and completion > 1:
            tpot = (duration - ttft) / (completion - 1)
        model, variant = target.model, target.variant
        self.metrics.variant_requests.inc(
            tags={"model": model, "variant": variant, "backend": ctx.backend, "status": str(status)}
        )
        if answered and ttft is not None:
            self.metrics.variant_ttft.observe(ttft, tags={"model": model, "variant": variant})
        if tpot is not None:
            self.metrics.variant_tpot.observe(tpot, tags={"model": model, "variant": variant})
        # A 4xx (the request's or the tenant's doing) or a client that left says nothing of it.
        if self.watch is not None and (failed or status < 400):
            ttft_s = ttft if answered else None
            self.watch.observe(model, variant, failed=failed, ttft_s=ttft_s, tpot_s=tpot)
