"""The tenant's budgets. Reserve before serving, settle to real usage after.

Runs before the cache, so a tenant out of tokens is out even for cached answers. One atomic
store call takes a request and ``prompt + max_tokens`` tokens; a concurrent-request lease is
held for the request's life. When the response ends, however it ends, the reservation settles
exactly once to the backend's ``usage`` (or, for a stream the client abandoned, to what was
relayed). The store is a convenience: when it fails the request is served unmetered, counted in
``forge_store_errors_total{op}`` and ``forge_unmetered_total{tenant}``, and a warning is logged
at most once per interval.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping

from starlette.responses import Response

from serve_app.config.models import TenantConfig
from serve_app.metering.ledger import charged_tokens
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import Handler, RequestContext, on_response_end
from serve_app.protocol import count_prompt_tokens
from serve_app.stages.quota_buckets import TenantQuota
from serve_app.stages.store_failures import StoreFailures
from serve_app.store import Store, StoreError

# A lease outlives its request by this much if the gateway dies; live streams renew it.
LEASE_TTL_S = 60.0


class QuotaStage:
    def __init__(
        self,
        store: Store,
        metrics: ForgeMetrics,
        tenants: list[TenantConfig],
        default_max_tokens: Mapping[str, int],
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.quotas = {t.name: TenantQuota.of(t) for t in tenants}
        self.default_max_tokens = default_max_tokens
        self._settling: set[asyncio.Task] = set()
        self._store_failed = StoreFailures(metrics, "serving unmetered")

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        quota = self.quotas[ctx.tenant.name]
        if quota.unlimited:
            return await call_next(ctx)
        prompt_tokens = ctx.prompt_estimate = count_prompt_tokens(ctx.body, ctx.route)
        max_tokens = ctx.parsed.output_limit()
        if max_tokens is None:
            max_tokens = self.default_max_tokens.get(ctx.parsed.model, 256)
        reserved = prompt_tokens + max_tokens
        quota.check_fits(reserved, prompt_tokens, max_tokens)
        buckets, amounts = quota.plan(reserved)

        reserved_in_store = False
        lease: str | None = None
        headers: dict[str, str] = {}
        try:
            if buckets:
                taken = await self.store.take(buckets, amounts)
                if not taken.granted:
                    self.metrics.shed.inc(tags={"tenant": quota.tenant, "reason": "rate_limit"})
                    raise quota.refused(buckets, amounts, taken)
                reserved_in_store = True
                headers = quota.headers(buckets, taken.remaining)
            lease = await self._acquire_lease(quota, ctx, buckets, amounts, headers)
        except StoreError as exc:
            # Served without a lease; a reservation already taken is still settled (refunded).
            self._store_failed("reserve", exc)
            self.metrics.unmetered.inc(tags={"tenant": quota.tenant})
        metered = reserved_in_store or lease is not None

        settled = False
        renewer = asyncio.create_task(self._keep_lease(quota, lease)) if lease is not None else None

        def settle(completed: bool) -> None:
            nonlocal settled
            if renewer is not None:
                renewer.cancel()
            if settled or not metered:
                return
            settled = True
            task = asyncio.create_task(self._settle(quota, ctx, prompt_tokens, reserved, lease))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

        try:
            response = await call_next(ctx)
        except BaseException:
            settle(False)
            raise
        response.headers.update(headers)
        return on_response_end(response, settle)

    async def _acquire_lease(
        self, quota: TenantQuota, ctx: RequestContext, buckets, amounts, headers: dict[str, str]
    ) -> str | None:
        if quota.max_streams is None:
            return None
        lease_id = f"{ctx.request_id}:{uuid.uuid4().hex[:8]}"
        granted, holders = await self.store.acquire_lease(
            quota.stream_key, lease_id, quota.max_streams, LEASE_TTL_S
        )
        if not granted:
            # Give back what this request took: it is refused, not served. A refund the store
            # fails is lost (counted), but the refusal stands: the cap is what the store said.
            try:
                for bucket, amount in zip(buckets, amounts, strict=True):
                    await self.store.adjust(bucket, amount)
            except StoreError as exc:
                self._store_failed("refund", exc)
            self.metrics.shed.inc(tags={"tenant": quota.tenant, "reason": "concurrency"})
            raise quota.too_many_streams(holders)
        # This request included: a client (or the gate) sees leaked leases as a low remainder.
        headers["x-ratelimit-limit-concurrent-requests"] = str(quota.max_streams)
        headers["x-ratelimit-remaining-concurrent-requests"] = str(
            max(0, quota.max_streams - holders)
        )
        return lease_id

    async def _keep_lease(self, quota: TenantQuota, lease: str) -> None:
        """Renew a live request's lease at a third of its TTL: a 10-minute stream keeps it."""
        while True:
            await asyncio.sleep(LEASE_TTL_S / 3)
            try:
                await self.store.renew_lease(quota.stream_key, lease, LEASE_TTL_S)
            except StoreError as exc:
                self._store_failed("renew", exc)

    async def _settle(
        self,
        quota: TenantQuota,
        ctx: RequestContext,
        prompt_tokens: int,
        reserved: int,
        lease: str | None,
    ) -> None:
        try:
            if quota.tokens is not None:
                prompt, completion, _ = charged_tokens(ctx)
                used = prompt + completion
                if used != reserved:
                    await self.store.adjust(quota.tokens, reserved - used)
        except StoreError as exc:
            self._store_failed("settle", exc)
        finally:
            if lease is not None:
                try:
                    await self.store.release_lease(quota.stream_key, lease)
                except StoreError as exc:
                    self._store_failed("release", exc)
