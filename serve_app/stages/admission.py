"""Fair admission: a slot of the pool, from its scheduler, before dispatch.

A slot parked on this gateway replica is taken at once when nobody is queued (no call at all);
otherwise one scheduler call acquires one (it may wait in the tenant's queue up to the deadline).
``admission/warm_slots.py`` keeps the parked slots and batches what the scheduler must hear. The
slot is released on every exit path. A long generation's lease is renewed so the scheduler does
not reclaim a live slot: by ``WarmSlots``, for all of this replica's requests in one call a
period. If the scheduler cannot be reached the request is admitted (fail open) and counted:
admission protects latency, it must never become the outage.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import replace

from starlette.responses import Response

from serve_app import errors
from serve_app.admission.client import Lease
from serve_app.admission.scheduler import Shed
from serve_app.admission.warm_slots import WarmSlots
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import MAX_REQUEST_LIFE_S, Handler, RequestContext, on_response_end
from serve_app.traffic.policy import Target

logger = logging.getLogger("ray.serve")

PRIORITY_HEADER = "x-forge-priority"
_WARN_EVERY_S = 30.0


class AdmissionStage:
    def __init__(
        self,
        slots: Mapping[str, WarmSlots],
        deadlines: Mapping[str, float],
        metrics: ForgeMetrics,
        lifetimes: Mapping[str, float] | None = None,
    ) -> None:
        """``lifetimes``: model → how long a request may hold its slot at most (its total
        deadline and then some): its lease's renewals stop then, even if the response's end is
        somehow never seen."""
        self.slots = slots  # model name → its pool's slots, as this gateway replica sees them
        self.deadlines = deadlines
        self.lifetimes = lifetimes or {}
        self.metrics = metrics
        self._last_warning = 0.0

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        tenant = ctx.tenant.name
        tier = self._tier(ctx)
        while True:
            slots = self.slots.get(ctx.pool_model)
            if slots is None:
                return await call_next(ctx)
            spill = _spills_to(ctx.target)
            try:
                lease = slots.take_parked(tenant, tier) or await self._acquire(
                    slots, ctx, tier, None if spill is None else ctx.target.overload_wait_s
                )
            except Overloaded as overloaded:
                self._spilled(ctx, spill, overloaded.reason)
                continue
            break
        if lease is None:  # the scheduler could not be asked: admitted without a slot
            return await call_next(ctx)

        self.metrics.admitted.inc(tags={"tenant": tenant})
        slots.keep_alive(lease.lease_id, self.lifetimes.get(ctx.pool_model, MAX_REQUEST_LIFE_S))
        released = False

        def release(completed: bool = True) -> None:
            nonlocal released
            if not released:  # once: a parked slot's lease id may be lent again
                released = True
                slots.release(lease.lease_id)

        ctx.release_slot = release
        try:
            response = await call_next(ctx)
        except BaseException:
            release()
            raise
        return on_response_end(response, release)

    async def _acquire(
        self, slots: WarmSlots, ctx: RequestContext, tier: str, spill_after_s: float | None
    ) -> Lease | None:
        """A slot, None (fail open), a 429, or ``Overloaded`` where the model's chain takes the
        request on past ``spill_after_s`` of waiting."""
        tenant = ctx.tenant.name
        wait_limit = self.deadlines[ctx.pool_model] + 5.0
        try:
            # wait_for, not asyncio.timeout: around a handle's await the latter did not fire here.
            return await asyncio.wait_for(slots.acquire(tenant, tier, spill_after_s), wait_limit)
        except Shed as shed:
            if spill_after_s is not None:
                raise Overloaded(shed.reason) from None
            self.metrics.shed.inc(tags={"tenant": tenant, "reason": shed.reason})
            retry = max(1, math.ceil(shed.retry_after_s))
            raise errors.rate_limited(
                f"The model is at capacity and tenant {tenant}'s queue cannot take this request "
                f"({shed.reason}). Try again in {retry}s.",
                kind="capacity",
                headers={"retry-after": str(retry)},
            ) from None
        except Exception as exc:  # scheduler unreachable or slow: admit, and say so
            self._fail_open(exc)
            return None

    async def aclose(self) -> None:
        """Give this replica's parked slots back (it is shutting down)."""
        for slots in self.slots.values():
            await slots.aclose()

    def _spilled(self, ctx: RequestContext, to: int, reason: str) -> None:
        target = ctx.target
        self.metrics.spills.inc(
            tags={
                "model": target.model,
                "source": target.steps[target.start].backend,
                "to": target.steps[to].backend,
                "reason": reason,  # the scheduler's: deadline (no slot in time), queue_full, ...
            }
        )
        ctx.target = replace(target, start=to)

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


class Overloaded(Exception):
    """The pool had no slot within the model's ``overload_wait_s``: its chain takes it on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _spills_to(target: Target | None) -> int | None:
    """The step a request goes on to when its pool is overloaded, if its model's chain has one
    (a pool's own name waits in the pool's queue, as it always has)."""
    if target is None or target.variant is None:
        return None
    for i in range(target.start + 1, len(target.steps)):
        step = target.steps[i]
        if "overload" in step.on and step.backend not in target.excluded:
            return i
    return None
