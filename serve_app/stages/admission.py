"""Fair admission: a slot of the pool, from its scheduler, before dispatch.

One scheduler call to acquire (it may wait in the tenant's queue up to the deadline);
the release, on every exit path, rides along with the gateway's next acquire, or goes on its own
after at most ``RELEASE_FLUSH_S`` when no acquire comes (a quiet gateway). A long generation
renews its lease so the scheduler does not reclaim a live slot. If the scheduler cannot be
reached the request is admitted (fail open) and counted: admission protects latency, it must
never become the outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Mapping

from starlette.responses import Response

from serve_app import errors
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import Handler, RequestContext, on_response_end
from serve_app.scheduler import Shed
from serve_app.scheduler_client import Lease, SchedulerClient

logger = logging.getLogger("ray.serve")

PRIORITY_HEADER = "x-forge-priority"
# Longest a freed slot waits for a ride on an acquire before it is released on its own.
RELEASE_FLUSH_S = 0.005
_WARN_EVERY_S = 30.0


class AdmissionStage:
    def __init__(
        self,
        schedulers: Mapping[str, SchedulerClient],
        deadlines: Mapping[str, float],
        metrics: ForgeMetrics,
    ) -> None:
        self.schedulers = schedulers  # model name → its pool's scheduler
        self.deadlines = deadlines
        self.metrics = metrics
        self._last_warning = 0.0
        self._releases = {model: _ReleaseBatch(handle) for model, handle in schedulers.items()}

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        scheduler = self.schedulers.get(ctx.parsed.model)
        if scheduler is None:
            return await call_next(ctx)
        tenant = ctx.tenant.name
        wait_limit = self.deadlines[ctx.parsed.model] + 5.0
        releases = self._releases[ctx.parsed.model]
        released = releases.take()
        try:
            # wait_for, not asyncio.timeout: around a handle's await the latter did not fire here.
            lease = await asyncio.wait_for(
                scheduler.acquire(tenant, self._tier(ctx), released), wait_limit
            )
        except Shed as shed:
            self.metrics.shed.inc(tags={"tenant": tenant, "reason": shed.reason})
            retry = max(1, math.ceil(shed.retry_after_s))
            raise errors.rate_limited(
                f"The model is at capacity and tenant {tenant}'s queue cannot take this request "
                f"({shed.reason}). Try again in {retry}s.",
                kind="capacity",
                headers={"retry-after": str(retry)},
            ) from None
        except Exception as exc:  # scheduler unreachable or slow: admit, and say so
            releases.restore(released)  # those slots are still to be given back
            self._fail_open(exc)
            return await call_next(ctx)

        self.metrics.admitted.inc(tags={"tenant": tenant})
        renewer = asyncio.create_task(_keep_alive(scheduler, lease))
        released = False

        def release(completed: bool = True) -> None:
            nonlocal released
            if not released:
                released = True
                renewer.cancel()
                releases.add(lease.lease_id)

        ctx.release_slot = release
        try:
            response = await call_next(ctx)
        except BaseException:
            release()
            raise
        return on_response_end(response, release)

    def _tier(self, ctx: RequestContext) -> str:
        tenant = ctx.tenant
        asked = ctx.request.headers.get(PRIORITY_HEADER)
        if tenant.allow_priority_header and asked in ("interactive", "batch"):
            return asked
        return tenant.tier

    def _fail_open(self, exc: Exception) -> None:
        self.metrics.admission_errors.inc()
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            logger.warning("scheduler unavailable (%r); admitting without a slot", exc)


async def _keep_alive(scheduler: SchedulerClient, lease: Lease) -> None:
    """Renew a held lease at a third of its TTL for as long as the request runs."""
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            await asyncio.sleep(lease.ttl_s / 3)
            with contextlib.suppress(Exception):
                await scheduler.renew(lease.lease_id)


class _ReleaseBatch:
    """Freed leases waiting to ride on the next acquire, flushed alone if none comes soon."""

    def __init__(self, scheduler: SchedulerClient) -> None:
        self.scheduler = scheduler
        self.pending: list[str] = []
        self._flush: asyncio.TimerHandle | None = None

    def add(self, lease_id: str) -> None:
        self.pending.append(lease_id)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(RELEASE_FLUSH_S, self._send)

    def take(self) -> list[str]:
        taken, self.pending = self.pending, []
        return taken

    def restore(self, lease_ids: list[str]) -> None:
        for lease_id in lease_ids:
            self.add(lease_id)

    def _send(self) -> None:
        self._flush = None
        if self.pending:
            self.scheduler.release(self.take())
