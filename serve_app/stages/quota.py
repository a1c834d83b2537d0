"""The tenant's budgets. Reserve before serving, settle to real usage after.

Runs before the cache, so a tenant out of tokens is out even for cached answers. One atomic
store call takes a request and ``prompt + max_tokens`` tokens; a concurrent-request lease is
held for the request's life. When the response ends, however it ends, the reservation settles
exactly once to the backend's ``usage`` (or, for a stream the client abandoned, to what was
relayed). The store is a convenience: when it fails the request is served unmetered, counted in
``forge_store_errors_total{op}`` and ``forge_unmetered_total{tenant}``, and a warning is logged
at most once per interval. What a request owes back (a refund, its lease) always lands:
``stages/settles.py`` retries it until the store confirms it, also when the reserve itself was
cut short (a timeout that may have been applied, a client that left mid-call).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Mapping

from starlette.responses import Response

from serve_app.config.models import TenantConfig
from serve_app.metering.ledger import charged_tokens
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import Handler, RequestContext, on_response_end
from serve_app.protocol import count_prompt_tokens
from serve_app.stages.quota_buckets import TenantQuota
from serve_app.stages.settles import Settles
from serve_app.stages.store_failures import StoreFailures
from serve_app.store import Store, StoreError

# A lease outlives its request by this much if the gateway dies; live streams renew it.
LEASE_TTL_S = 60.0
MAX_LEASE_LIFE_S = 3600.0  # the renewer's bound when nothing says how long a request may take


class QuotaStage:
    def __init__(
        self,
        store: Store,
        metrics: ForgeMetrics,
        tenants: list[TenantConfig],
        default_max_tokens: Mapping[str, int],
        settles: Settles | None = None,
        settle_store: Store | None = None,
        lifetimes: Mapping[str, float] | None = None,
    ) -> None:
        """``settles`` lands refunds and releases (the replica's own, kept across rebuilds);
        ``settle_store``: the store they go through (the patient one; ``store`` by default);
        ``lifetimes``: model → how long a request's lease is renewed at most (its deadline and
        some slack; then it lapses by itself, whatever became of its request)."""
        self.lifetimes = lifetimes or {}
        self.store = store
        self.metrics = metrics
        self.quotas = {t.name: TenantQuota.of(t) for t in tenants}
        self.default_max_tokens = default_max_tokens
        self._store_failed = StoreFailures(metrics, "serving unmetered")
        self.settles = settles or Settles(StoreFailures(metrics, "retried until it lands"))
        self.settle_store = settle_store or store

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
        # Minted before the call: a call cut short may have taken it, and it is released then.
        lease_id = None if quota.max_streams is None else uuid.uuid4().hex
        settle_id = uuid.uuid4().hex  # the refunds' idempotency id (client ids may repeat)
        asking = False
        headers: dict[str, str] = {}
        try:
            if buckets:
                taken = await self.store.take(buckets, amounts)
                if not taken.granted:
                    self.metrics.shed.inc(tags={"tenant": quota.tenant, "reason": "rate_limit"})
                    raise quota.refused(buckets, amounts, taken)
                reserved_in_store = True
                headers = quota.headers(buckets, taken.remaining)
            if lease_id is not None:
                asking = True  # the store may grant it even if its answer never arrives
                granted, holders = await self.store.acquire_lease(
                    quota.stream_key, lease_id, quota.max_streams, LEASE_TTL_S
                )
                asking = False
                if not granted:
                    self.metrics.shed.inc(tags={"tenant": quota.tenant, "reason": "concurrency"})
                    raise quota.too_many_streams(holders)
                lease = lease_id
                # This request included: a client (or the gate) sees leaked leases as a low
                # remainder.
                headers["x-ratelimit-limit-concurrent-requests"] = str(quota.max_streams)
                headers["x-ratelimit-remaining-concurrent-requests"] = str(
                    max(0, quota.max_streams - holders)
                )
        except StoreError as exc:
            # Served without a lease (one the store may have granted before failing to answer
            # is released); a reservation already taken is still settled (refunded).
            self._store_failed("reserve", exc)
            self.metrics.unmetered.inc(tags={"tenant": quota.tenant})
            if asking:
                self._release(quota, lease_id)
        except BaseException:
            # Refused a lease, or cut short (the client left, the request was cancelled):
            # nothing taken is left behind.
            if asking:
                self._release(quota, lease_id)
            if reserved_in_store:
                self._refund(quota, buckets, amounts, f"{settle_id}:reserve")
            raise
        metered = reserved_in_store or lease is not None

        settled = False
        renewer = None
        if lease is not None:
            life = self.lifetimes.get(ctx.parsed.model, MAX_LEASE_LIFE_S)
            renewer = asyncio.create_task(self._keep_lease(quota, lease, life))

        def settle(completed: bool) -> None:
            nonlocal settled
            if renewer is not None:
                renewer.cancel()
            if settled or not metered:
                return
            settled = True
            self._settle(quota, ctx, reserved, lease, settle_id)

        try:
            response = await call_next(ctx)
        except BaseException:
            settle(False)
            raise
        response.headers.update(headers)
        return on_response_end(response, settle)

    async def _keep_lease(self, quota: TenantQuota, lease: str, max_life_s: float) -> None:
        """Renew a live request's lease at a third of its TTL: a 10-minute stream keeps it;
        past ``max_life_s`` no request is live, and the lease lapses by itself."""
        for _ in range(max(1, math.ceil(max_life_s / (LEASE_TTL_S / 3)))):
            await asyncio.sleep(LEASE_TTL_S / 3)
            try:
                if not await self.store.renew_lease(quota.stream_key, lease, LEASE_TTL_S):
                    # Gone (the store was flushed or failed over): the live stream takes its
                    # place back, counted against the cap again, rather than running unseen.
                    await self.store.acquire_lease(
                        quota.stream_key, lease, quota.max_streams, LEASE_TTL_S
                    )
            except StoreError as exc:
                self._store_failed("renew", exc)

    def _settle(
        self, quota: TenantQuota, ctx: RequestContext, reserved: int, lease: str | None, id_: str
    ) -> None:
        """The reservation to the real usage (a refund, or the overshoot charged), and the
        lease back: both retried until they land (``Settles``)."""
        calls = []
        if quota.tokens is not None:
            prompt, completion, _ = charged_tokens(ctx)
            used = prompt + completion
            if used != reserved:
                tokens, delta = quota.tokens, reserved - used
                calls.append(lambda: self.settle_store.adjust(tokens, delta, once=id_))
        if lease is not None:
            calls.append(lambda: self.settle_store.release_lease(quota.stream_key, lease))
        if calls:
            self.settles.land("settle", *calls)

    def _refund(self, quota: TenantQuota, buckets, amounts, id_: str) -> None:
        store = self.settle_store
        self.settles.land(
            "refund",
            *(
                lambda b=bucket, a=amount: store.adjust(b, a, once=f"{id_}:{b.key}")
                for bucket, amount in zip(buckets, amounts, strict=True)
            ),
        )

    def _release(self, quota: TenantQuota, lease_id: str) -> None:
        key = quota.stream_key
        self.settles.land("release", lambda: self.settle_store.release_lease(key, lease_id))
