"""The scheduler deployment: one ``FairScheduler`` per pool, shared by every gateway replica.

A Serve deployment with exactly one replica rather than a detached actor: it lives and dies
with the application (a redeploy replaces it, Serve restarts it if its health check fails), it
shows in the Serve dashboard next to the pool it guards, and the gateway reaches it through an
ordinary handle wired in the app builder. Slot state is in memory on purpose: after a restart,
every lease is gone and the pool starts with all slots free, which errs towards admitting.
"""

from __future__ import annotations

import asyncio

from ray.serve.metrics import Gauge

from serve_app import scheduler as fair
from serve_app.config import AdmissionConfig, TenantConfig

_EXPORT_EVERY_S = 1.0


class SchedulerDeployment:
    def __init__(self, pool: str, admission: dict, tenants: list[dict]) -> None:
        self.pool = pool
        config = AdmissionConfig.model_validate(admission)
        self.config = config
        self.scheduler = fair.FairScheduler(
            config.max_inflight,
            default_tenant=fair.TenantShare(queue_cap=config.queue_cap),
            tenants={t.name: _share(t, config) for t in map(TenantConfig.model_validate, tenants)},
            lease_ttl_s=config.lease_ttl_s,
            max_queued_total=config.max_queued_total,
            batch_every=config.batch_every,
            max_tenant_share=config.max_tenant_share,
        )
        self._queue_depth = Gauge(
            "forge_queue_depth",
            description="Requests waiting for a slot, by pool and tenant.",
            tag_keys=("pool", "tenant"),
        )
        self._slots = Gauge(
            "forge_slots_in_use",
            description="Admission slots held, by pool.",
            tag_keys=("pool",),
        )
        self._housekeeping: asyncio.Task | None = None

    def _ensure_housekeeping(self) -> None:
        if self._housekeeping is None or self._housekeeping.done():
            self._housekeeping = asyncio.get_running_loop().create_task(self._housekeep())

    async def _housekeep(self) -> None:
        """Reclaim dead holders' slots and export gauges; the only periodic work."""
        seen: set[str] = set()
        while True:
            self.scheduler.expire_leases()
            snap = self.scheduler.snapshot()
            seen |= set(snap.queued)
            for tenant in seen:
                depth = snap.queued.get(tenant, 0)
                self._queue_depth.set(depth, tags={"pool": self.pool, "tenant": tenant})
            self._slots.set(snap.slots_used, tags={"pool": self.pool})
            await asyncio.sleep(_EXPORT_EVERY_S)

    async def acquire(
        self, tenant: str, tier: str | None, released: list[str] = ()
    ) -> tuple[str, float]:
        """A lease id and its TTL, or ``scheduler.Shed`` (raised through the handle).

        ``released``: leases the caller freed since its last call, piggybacked so that a busy
        gateway pays one scheduler round trip per request, not two. They are released first,
        so their slots go to whoever waited longest, as a separate release call would.
        """
        self._ensure_housekeeping()
        self.release(released)
        grant = await self.scheduler.acquire(tenant, tier=tier, deadline_s=self.config.deadline_s)
        return grant.lease_id, grant.expires_at - grant.granted_at

    def release(self, lease_ids: list[str]) -> int:
        return sum(self.scheduler.release(lease_id) for lease_id in lease_ids)

    def renew(self, lease_id: str) -> bool:
        return self.scheduler.renew(lease_id) is not None

    def snapshot(self) -> dict:
        snap = self.scheduler.snapshot()
        return {
            "slots_total": snap.slots_total,
            "slots_used": snap.slots_used,
            "queued": snap.queued,
            "inflight": snap.inflight,
            "granted": snap.granted,
            "shed": {f"{t}:{r}": n for (t, r), n in snap.shed.items()},
            "expired_leases": snap.expired_leases,
        }


def _share(tenant: TenantConfig, config: AdmissionConfig) -> fair.TenantShare:
    queue_cap = tenant.queue_cap if tenant.queue_cap is not None else config.queue_cap
    return fair.TenantShare(weight=tenant.weight, queue_cap=queue_cap, tier=tenant.tier)
