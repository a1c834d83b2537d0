"""The tenant's budgets. Reserve before serving, settle to real usage after.

Runs before the cache, so a tenant out of tokens is out even for cached answers. One atomic
store call takes a request and ``prompt + max_tokens`` tokens; a concurrent-request lease is
held for the request's life (renewed with every other live request's, one store round trip a
period: ``stages/lease_keeper.py``). When the response ends, however it ends, the reservation
settles exactly once to the backend's ``usage`` (or, for a stream the client abandoned, to what
was relayed). The store is a convenience: when it fails the request is served unmetered, counted
in ``forge_store_errors_total{op}`` and ``forge_unmetered_total{tenant}``, and a warning is
logged at most once per interval. What a request owes back (a refund, its lease) always lands:
``stages/settles.py`` retries it until the store confirms it, also when the reserve itself was
cut short (a timeout that may have been applied, a client that left mid-call).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.responses import Response

from serve_app import errors
from serve_app.config.models import TenantConfig
from serve_app.metering.ledger import charged_tokens
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import MAX_REQUEST_LIFE_S, Handler, RequestContext, on_response_end
from serve_app.stages.lease_keeper import LeaseKeeper
from serve_app.stages.quota_buckets import TenantQuota
from serve_app.stages.settles import Settles
from serve_app.stages.store_failures import StoreFailures
from serve_app.store import MemoryStore, Store, StoreError, StoreSkipped

# A lease outlives its request by this much if the gateway dies; live streams renew it.
LEASE_TTL_S = 60.0


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
        local_share: float = 1.0,
    ) -> None:
        """``settles`` lands refunds and releases (the replica's own, kept across rebuilds);
        ``settle_store``: the store they go through (the patient one; ``store`` by default);
        ``lifetimes``: model → how long a request's lease is renewed at most (its deadline and
        some slack; then it lapses by itself, whatever became of its request);
        ``local_share``: this replica's share of each budget while the store is unreachable
        (1 / the gateway replicas it knows of)."""
        self.lifetimes = lifetimes or {}
        self.store = store
        self.metrics = metrics
        self.quotas = {t.name: TenantQuota.of(t) for t in tenants}
        self.default_max_tokens = default_max_tokens
        self._store_failed = StoreFailures(
            metrics, "budgets held as each tenant's on_store_failure says (local, open, closed)"
        )
        self.leases = LeaseKeeper(LEASE_TTL_S, self._store_failed)
        self.settles = settles or Settles(StoreFailures(metrics, "retried until it lands"))
        self.settle_store = settle_store or store
        # While the shared store is unreachable: this replica's share of every budget, here.
        self.local_store = MemoryStore()
        self.local_quotas = {t.name: TenantQuota.of(t, share=local_share) for t in tenants}

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        quota = self.quotas[ctx.tenant.name]
        if quota.unlimited:
            return await call_next(ctx)
        prompt_tokens = ctx.counted_prompt()  # parse counted it where a model's route needed it
        max_tokens = ctx.parsed.output_limit()
        if max_tokens is None:
            max_tokens = self.default_max_tokens.get(ctx.pool_model, 256)
        reserved = prompt_tokens + max_tokens
        quota.check_fits(reserved, prompt_tokens, max_tokens)

        # Ids minted before the calls: a call cut short may have taken its lease, which is then
        # released; the refunds' idempotency id is ours (client ids may repeat).
        held = _Held(self.store, quota, None if quota.max_streams is None else uuid.uuid4().hex)
        settle_id = uuid.uuid4().hex
        headers: dict[str, str] = {}
        try:
            await self._reserve(held, reserved, headers)
        except StoreError as exc:
            self._store_failed("reserve", exc)
            if held.asking and not isinstance(exc, StoreSkipped):
                self._release(held)  # the store may have granted it before failing to answer
            held = await self._on_store_failure(ctx, held, reserved, settle_id, headers)
        except BaseException:
            # Refused a lease, or cut short (the client left, the request was cancelled):
            # nothing taken is left behind.
            if held.asking:
                self._release(held)
            if held.reserved:
                self._refund(held, reserved, f"{settle_id}:reserve")
            raise

        settled = False
        if held.lease is not None:
            life = self.lifetimes.get(ctx.pool_model, MAX_REQUEST_LIFE_S)
            key, cap = held.quota.stream_key, held.quota.max_streams  # the local share's, maybe
            self.leases.keep(held.store, key, held.lease, cap, life)

        def settle(completed: bool) -> None:
            nonlocal settled
            if held.lease is not None:
                self.leases.drop(held.lease)
            if settled or not (held.reserved or held.lease is not None):
                return
            settled = True
            self._settle(held, ctx, reserved, settle_id)

        try:
            response = await call_next(ctx)
        except BaseException:
            settle(False)
            raise
        response.headers.update(headers)
        return on_response_end(response, settle)

    async def _reserve(self, held: _Held, reserved: int, headers: dict[str, str]) -> None:
        """Take the request and its tokens and a stream lease from ``held.store`` (both in one
        call where the tenant has both); a 429 for what the tenant's budget cannot give."""
        quota = held.quota
        buckets, amounts = quota.plan(reserved)
        if buckets and held.lease_id is not None:  # both: one round trip, both or neither
            held.asking, held.together = True, (buckets, amounts)
            both = await held.store.reserve(
                buckets, amounts, quota.stream_key, held.lease_id, quota.max_streams, LEASE_TTL_S
            )
            held.asking = False
            if both.refused == "buckets":
                self.metrics.shed.inc(tags={"tenant": quota.tenant, "reason": "rate_limit"})
                raise quota.refused(buckets, amounts, both.take)
            if both.refused == "lease":
                self.metrics.shed.inc(tags={"tenant": quota.tenant, "reason": "concurrency"})
                raise quota.too_many_streams(both.holders)
            held.reserved, held.lease = True, held.lease_id
            headers.update(quota.headers(buckets, both.take.remaining))
            self._lease_headers(quota, both.holders, headers)
            return
        if buckets:
            taken = await held.store.take(buckets, amounts)
            if not taken.granted:
                self.metrics.shed.inc(tags={"tenant": quota.tenant, "reason": "rate_limit"})
                raise quota.refused(buckets, amounts, taken)
            held.reserved = True
            headers.update(quota.headers(buckets, taken.remaining))
        if held.lease_id is not None:
            held.asking = True
            granted, holders = await held.store.acquire_lease(
                quota.stream_key, held.lease_id, quota.max_streams, LEASE_TTL_S
            )
            held.asking = False
            if not granted:
                self.metrics.shed.inc(tags={"tenant": quota.tenant, "reason": "concurrency"})
                raise quota.too_many_streams(holders)
            held.lease = held.lease_id
            self._lease_headers(quota, holders, headers)

    @staticmethod
    def _lease_headers(quota: TenantQuota, holders: int, headers: dict[str, str]) -> None:
        # This request included: a client (or the gate) sees leaked leases as a low remainder.
        headers["x-ratelimit-limit-concurrent-requests"] = str(quota.max_streams)
        headers["x-ratelimit-remaining-concurrent-requests"] = str(
            max(0, quota.max_streams - holders)
        )

    async def _on_store_failure(
        self, ctx: RequestContext, held: _Held, reserved: int, settle_id: str, headers: dict
    ) -> _Held:
        """The shared store failed this request's reserve: what the tenant's
        ``on_store_failure`` says. ``local`` (the default): this gateway replica's share of
        the tenant's budgets, in its own memory; ``open``: served unmetered; ``closed``: a 503.
        What the shared store did take (a reservation before the lease call failed) is still
        settled there."""
        tenant = ctx.tenant
        mode = tenant.on_store_failure
        if mode == "closed":
            if held.reserved:
                self._refund(held, reserved, f"{settle_id}:closed")
            self.metrics.shed.inc(tags={"tenant": tenant.name, "reason": "store_unavailable"})
            raise errors.unavailable("The budget store", "budget_store_unavailable")
        if mode == "open" or held.reserved:
            self.metrics.unmetered.inc(tags={"tenant": tenant.name})
            return held
        local = _Held(self.local_store, self.local_quotas[tenant.name], held.lease_id)
        self.metrics.locally_metered.inc(tags={"tenant": tenant.name})
        try:
            await self._reserve(local, reserved, headers)
        except BaseException:
            if local.reserved:
                self._refund(local, reserved, f"{settle_id}:reserve")
            raise
        return local

    def _settles_store(self, held: _Held) -> Store:
        """Where ``held``'s settles go: the patient store for the shared one, else its own."""
        return self.settle_store if held.store is self.store else held.store

    def _settle(self, held: _Held, ctx: RequestContext, reserved: int, id_: str) -> None:
        """The reservation to the real usage (a refund, or the overshoot charged), and the
        lease back: both retried until they land (``Settles``)."""
        store, quota, lease = self._settles_store(held), held.quota, held.lease
        delta = 0
        if held.reserved and quota.tokens is not None:
            prompt, completion, _ = charged_tokens(ctx)
            delta = reserved - (prompt + completion)
        tokens, key = quota.tokens, quota.stream_key
        if delta and lease is not None:  # one round trip for both (``Store.settle``)
            self.settles.land("settle", lambda: store.settle(tokens, delta, id_, key, lease))
        elif delta:
            self.settles.land("settle", lambda: store.adjust(tokens, delta, once=id_))
        elif lease is not None:
            self.settles.land("settle", lambda: store.release_lease(key, lease))

    def _refund(self, held: _Held, reserved: int, id_: str) -> None:
        store = self._settles_store(held)
        buckets, amounts = held.quota.plan(reserved)
        self.settles.land(
            "refund",
            *(
                lambda b=bucket, a=amount: store.adjust(b, a, once=f"{id_}:{b.key}")
                for bucket, amount in zip(buckets, amounts, strict=True)
            ),
        )

    def _release(self, held: _Held) -> None:
        """An unanswered lease call's lease back (and, asked together, the take with it)."""
        store, key, lease_id = self._settles_store(held), held.quota.stream_key, held.lease_id
        if held.together is not None:
            buckets, amounts = held.together
            self.settles.land("release", lambda: store.unreserve(buckets, amounts, key, lease_id))
            return
        self.settles.land("release", lambda: store.release_lease(key, lease_id))


@dataclass(slots=True)
class _Held:
    """What one request holds in one store: its reservation, its stream lease."""

    store: Store
    quota: TenantQuota
    lease_id: str | None  # minted before the call (released if the call's answer is lost)
    reserved: bool = False
    lease: str | None = None
    asking: bool = False  # a lease call under way: the store may grant it unanswered
    # The take asked with the lease in one call (``Store.reserve``): undone with it if unanswered.
    together: tuple[list, list] | None = None
