"""Metering: every request of a known tenant becomes one ``UsageRecord`` when it ends.

The design lists metering last because it records what dispatch (or the cache) answered; it
sits right after auth in the stage list so it also sees what the later stages refuse (a 400, a
429 from quota or admission) and counts it as an error of its class. The record goes to the
ledger, which writes it to its database off the request path, batched and retried until the
database takes it (``metering.ledger.UsageLedger``): a slow or absent database delays usage, it
does not lose it (failed writes are counted in ``forge_store_errors_total{op="meter"}``). The
Prometheus counters take the same record, so the two agree.
"""

from __future__ import annotations

import asyncio
import time

from starlette.responses import Response

from serve_app import errors
from serve_app.adapters import adapter_model
from serve_app.metering.ledger import UsageLedger, UsageRecord, charged_tokens, day_of, error_class
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import (
    Handler,
    RequestContext,
    error_status,
    final_status,
    on_response_end,
)


class MeterStage:
    def __init__(self, ledger: UsageLedger | None, metrics: ForgeMetrics) -> None:
        self.ledger = ledger  # None: metering off (Prometheus only)
        self.metrics = metrics

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        try:
            response = await call_next(ctx)
        except errors.ForgeError as err:
            self._record(ctx, error_status(ctx, err))
            raise
        except asyncio.CancelledError:
            self._record(ctx, 499)
            raise
        except Exception:
            self._record(ctx, 500)
            raise
        return on_response_end(
            response, lambda completed: self._record(ctx, final_status(ctx, response, completed))
        )

    def _record(self, ctx: RequestContext, status: int) -> None:
        record = usage_record(ctx, status, day_of(time.time()))
        self.metrics.meter(record)
        if self.ledger is not None:
            self.ledger.add(record)


def usage_record(ctx: RequestContext, status: int, day: str) -> UsageRecord:
    """What one request adds to its tenant's day (see ``metering.COUNTERS``)."""
    counts = {"requests": 1}
    prompt, completion, exact = charged_tokens(ctx)
    if ctx.cache == "hit":
        counts["cached_requests"] = 1
        counts["cached_tokens"] = prompt + completion
    else:
        counts["prompt_tokens"] = prompt
        counts["completion_tokens"] = completion
        if not exact:
            counts["estimated_requests"] = 1
    if ctx.backend == "fallback":
        counts["fallback_requests"] = 1
    failure = error_class(status)
    if failure is not None:
        counts[f"errors_{failure}"] = 1
    # Tokens the fallback processed are its model's, priced at its price (``forge usage``); a
    # cache hit replays an answer of the requested model's, whoever first produced it.
    model = ctx.served_model if ctx.served_model and ctx.cache != "hit" else ctx.model_label
    if ctx.adapter is not None and ctx.backend != "fallback":
        # An adapter's tokens are its own line, "<pool's model>:<adapter>", priced as such.
        served = ctx.served_model if ctx.served_model and ctx.cache != "hit" else None
        model = adapter_model(served or ctx.pool_model, ctx.adapter)
    return UsageRecord(ctx.tenant_name, model, day, counts)
