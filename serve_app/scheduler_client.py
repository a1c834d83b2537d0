"""How the admission stage talks to a pool's ``FairScheduler``: one small typed seam.

Two implementations: ``LocalSchedulerClient`` owns a ``FairScheduler`` in this process (the
scheduler deployment runs one; so do tests and a gateway served without Ray), and
``ServeSchedulerClient`` (``serve_app/scheduler_deployment.py``) reaches the pool's one scheduler
deployment through a Serve handle, so every gateway replica shares one slot budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from serve_app.config import AdmissionConfig, TenantConfig
from serve_app.scheduler import FairScheduler, TenantShare


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    ttl_s: float  # renew well before this, or the scheduler reclaims the slot


class SchedulerClient(Protocol):
    async def acquire(self, tenant: str, tier: str | None, released: Sequence[str] = ()) -> Lease:
        """A slot for ``tenant`` (waiting in its queue up to the pool's deadline), or raise
        ``scheduler.Shed``. ``released``: leases freed since the last call, given back first
        (so a busy gateway pays one round trip per request, not two)."""
        ...

    def release(self, lease_ids: Sequence[str]) -> None:
        """Give slots back without waiting for an answer."""
        ...

    async def renew(self, lease_id: str) -> bool:
        """Keep a live request's lease; False if the scheduler no longer knows it."""
        ...


class LocalSchedulerClient:
    """A ``FairScheduler`` in this process behind the ``SchedulerClient`` seam."""

    def __init__(self, scheduler: FairScheduler, deadline_s: float) -> None:
        self.scheduler = scheduler
        self.deadline_s = deadline_s

    async def acquire(self, tenant: str, tier: str | None, released: Sequence[str] = ()) -> Lease:
        # Released first, so their slots go to whoever waited longest, as a separate call would.
        self._give_back(released)
        grant = await self.scheduler.acquire(tenant, tier=tier, deadline_s=self.deadline_s)
        return Lease(grant.lease_id, grant.expires_at - grant.granted_at)

    def release(self, lease_ids: Sequence[str]) -> int:
        return self._give_back(lease_ids)

    def _give_back(self, lease_ids: Sequence[str]) -> int:
        return sum(self.scheduler.release(lease_id) for lease_id in lease_ids)

    async def renew(self, lease_id: str) -> bool:
        return self.scheduler.renew(lease_id) is not None


def fair_scheduler(admission: AdmissionConfig, tenants: Iterable[TenantConfig]) -> FairScheduler:
    """A pool's ``FairScheduler`` from its validated admission config and the tenants."""
    return FairScheduler(
        admission.max_inflight,
        default_tenant=TenantShare(queue_cap=admission.queue_cap),
        tenants={t.name: _share(t, admission) for t in tenants},
        lease_ttl_s=admission.lease_ttl_s,
        max_queued_total=admission.max_queued_total,
        batch_every=admission.batch_every,
        max_tenant_share=admission.max_tenant_share,
    )


def _share(tenant: TenantConfig, admission: AdmissionConfig) -> TenantShare:
    queue_cap = tenant.queue_cap if tenant.queue_cap is not None else admission.queue_cap
    return TenantShare(weight=tenant.weight, queue_cap=queue_cap, tier=tenant.tier)
