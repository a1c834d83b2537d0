"""The scheduler deployment: one ``FairScheduler`` per pool, shared by every gateway replica
(which reaches it through ``ServeSchedulerClient``, ``admission/client.py``).

A Serve deployment with exactly one replica rather than a detached actor: it lives and dies
with the application (a redeploy replaces it, Serve restarts it if its health check fails), it
shows in the Serve dashboard next to the pool it guards, and the gateway reaches it through an
ordinary handle wired in the app builder. Slot state is in memory on purpose: after a restart,
every lease is gone, and the gateways' renewals bring the live ones back within a third of a
lease's TTL (each gateway replica renews all its leases in one ``sync``; ``FairScheduler.renew``).
In the control application (``serve_app.app:build_control``) a change to the gateway's
application replaces neither it nor its leases.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from serve_app.admission.client import (
    LocalSchedulerClient,
    SlotOp,
    Unconfigured,
    admission_view,
    apply_ops,
    fair_scheduler,
)
from serve_app.admission.scheduler import Shed
from serve_app.config.digest import settings_digest
from serve_app.config.models import AdmissionConfig, TenantConfig
from serve_app.metrics import gauge

_EXPORT_EVERY_S = 1.0


def scheduler_deployment_name(pool: str) -> str:
    """A pool's scheduler, in the gateway's application or the control application."""
    return f"scheduler-{pool}"


class SchedulerDeployment:
    """``admission`` None: the settings come from the gateways (``configure``), as in the
    control application, whose args must not change with them (a change of an application's
    args replaces every deployment in it).

    Every method a handle calls is ``async``: Serve runs a replica's plain methods in a thread
    pool (``RAY_SERVE_RUN_SYNC_IN_THREADPOOL``, on by default), where a ``sync`` releasing a
    slot raced ``acquire`` on the event loop and the pool was granted 9 slots of 8."""

    def __init__(
        self, pool: str, admission: dict | None = None, tenants: Sequence[dict] = ()
    ) -> None:
        self.pool = pool
        self.local: LocalSchedulerClient | None = None
        self._configured = asyncio.Event()
        self._applied: str | None = None
        self._queue_depth = gauge(
            "forge_queue_depth",
            "Requests waiting for a slot, by pool and tenant.",
            "pool",
            "tenant",
        )
        self._slots = gauge("forge_slots_in_use", "Admission slots held, by pool.", "pool")
        self._parked = gauge(
            "forge_slots_parked",
            "Slots held by gateway replicas between requests, by pool (in slots_in_use).",
            "pool",
        )
        self._slots_total = gauge("forge_slots_total", "Admission slots a pool has.", "pool")
        self._housekeeping: asyncio.Task | None = None
        if admission is not None:
            self._start(admission, list(tenants))

    def _start(self, admission: dict, tenants: list[dict]) -> None:
        config = AdmissionConfig.model_validate(admission)
        self.local = LocalSchedulerClient(
            fair_scheduler(config, map(TenantConfig.model_validate, tenants)), config.deadline_s
        )
        self.scheduler = self.local.scheduler
        self._applied = settings_digest(admission, tenants)
        self._configured.set()

    def _ready(self) -> LocalSchedulerClient:
        if self.local is None:
            raise Unconfigured(self.pool)
        self._ensure_housekeeping()
        return self.local

    def _ensure_housekeeping(self) -> None:
        if self._housekeeping is None or self._housekeeping.done():
            self._housekeeping = asyncio.get_running_loop().create_task(self._housekeep())

    async def _housekeep(self) -> None:
        """Reclaim dead holders' slots and export gauges; the only periodic work. Its cost
        follows the tenants waiting, not the tenants configured (10,000 of them took 24 ms a
        pass on this loop when every tenant's gauge was set each second)."""
        shown: set[str] = set()  # tenants whose queue gauge was last set above zero
        scheduler, pool = self.scheduler, {"pool": self.pool}
        while True:
            scheduler.expire_leases()
            queued = scheduler.queued_by_tenant()
            for tenant in shown - queued.keys():
                self._queue_depth.set(0, tags={**pool, "tenant": tenant})
            for tenant, depth in queued.items():
                self._queue_depth.set(depth, tags={**pool, "tenant": tenant})
            shown = set(queued)
            self._slots.set(scheduler.slots_used, tags=pool)
            self._parked.set(scheduler.parked, tags=pool)
            self._slots_total.set(scheduler.max_inflight, tags=pool)
            await asyncio.sleep(_EXPORT_EVERY_S)

    async def acquire(
        self,
        tenant: str,
        tier: str | None,
        ops: Sequence[SlotOp] = (),
        wait_s: float | None = None,
    ) -> tuple[str, float, bool] | Shed:
        """A lease id, its TTL and whether the pool was contended, or the ``Shed`` refusal
        *returned*, not raised: an exception that leaves a replica is logged by Serve with its
        formatted traceback and rebuilt as a ``RayTaskError`` in the caller, which under a flood
        was half of this replica's busy CPU (py-spy: ``Logger.exception`` 11 % of all samples,
        ``docs/benchmarks.md``, "Cheap shedding"). ``ServeSchedulerClient`` raises it there."""
        try:
            lease = await self._ready().acquire(tenant, tier, ops, wait_s)
        except Shed as shed:
            return shed
        return lease.lease_id, lease.ttl_s, lease.contended

    async def sync(self, ops: list[SlotOp]) -> tuple[bool, tuple[str, ...]]:
        reply = apply_ops(self._ready().scheduler, ops)
        return reply.contended, reply.lost

    async def until_contended(self) -> None:
        await self._configured.wait()
        await self.scheduler.until_contended()

    async def renew(
        self, lease_id: str, tenant: str | None = None, tier: str = "interactive"
    ) -> bool:
        """One lease's renewal, as gateways before the batched one (a ``"renew"`` op in
        ``sync``) sent it: kept so they still renew against this scheduler while they drain."""
        scheduler = self._ready().scheduler
        return scheduler.renew(lease_id, tenant=tenant, tier=tier) is not None  # type: ignore[arg-type]

    async def configure(self, admission: dict, tenants: list[dict]) -> bool:
        """A live change from the gateway (each gateway replica sends the same one, and sends
        it again now and then: a restarted scheduler catches up). True if it changed anything."""
        digest = settings_digest(admission, tenants)
        if digest == self._applied:
            return False
        if self.local is None:
            self._start(admission, tenants)
            return True
        await self.local.configure(admission, tenants)
        self._applied = digest
        return True

    async def snapshot(self) -> dict:
        snap = self._ready().scheduler.snapshot()
        return admission_view(snap) | {
            "granted": snap.granted,
            "shed": {f"{t}:{r}": n for (t, r), n in snap.shed.items()},
            "expired_leases": snap.expired_leases,
            "adopted_leases": sum(snap.adopted.values()),
        }
