"""How a gateway replica talks to a pool's ``FairScheduler``: one small typed seam.

What crosses it: an ``acquire`` (which may wait in the tenant's queue), and ``SlotOp``s, the
gateway's notes on slots it already holds (claim a parked slot for a tenant, park a finished
one, release one, renew the lease of one in use), applied in order, riding on the next acquire
or sent alone by ``sync``: a gateway's renewals of all its requests' leases are one ``sync``.
Every answer says whether the pool is contended, so holders of parked slots know to give them
back; ``until_contended`` pushes that news. ``admission/warm_slots.py`` decides what to send.

Two implementations, side by side: ``LocalSchedulerClient`` owns a ``FairScheduler`` in this
process (the scheduler deployment runs one; so do tests and a gateway served without Ray), and
``ServeSchedulerClient`` reaches the pool's one scheduler deployment through a Serve handle, so
every gateway replica shares one slot budget.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ray.serve.handle import DeploymentHandle

from serve_app.admission.scheduler import FairScheduler, SchedulerSnapshot, Shed, TenantShare
from serve_app.config.models import AdmissionConfig, TenantConfig

# ("claim", lease_id, tenant, tier) | ("park", lease_id) | ("release", lease_id)
# | ("renew", lease_id, tenant, tier): plain tuples, because they cross a Serve handle on the
# request path and pickle small.
SlotOp = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    ttl_s: float  # renew well before this, or the scheduler reclaims the slot
    contended: bool = False  # someone was queued when this was granted


@dataclass(frozen=True, slots=True)
class SyncReply:
    contended: bool
    # Leases in the ops the scheduler no longer knows (a renewal: it was released, so it stays so)
    lost: tuple[str, ...] = ()


class Unconfigured(RuntimeError):
    """A scheduler with no settings yet (one in the control application, just started): the
    caller sends the pool's settings (``configure``) and asks again."""

    def __init__(self, pool: str = "") -> None:
        super().__init__(f"scheduler {pool!r} has no settings yet")
        self.pool = pool

    def __reduce__(self):
        return (Unconfigured, (self.pool,))


class SchedulerClient(Protocol):
    async def acquire(
        self,
        tenant: str,
        tier: str | None,
        ops: Sequence[SlotOp] = (),
        wait_s: float | None = None,
    ) -> Lease:
        """A slot for ``tenant`` (waiting in its queue up to the pool's deadline, or ``wait_s``
        where that is shorter), or raise ``scheduler.Shed``. ``ops`` are applied first (so a
        busy gateway pays one round trip per request, not two)."""
        ...

    async def sync(self, ops: Sequence[SlotOp]) -> SyncReply:
        """Apply ``ops`` in order; say whether anyone is queued."""
        ...

    async def until_contended(self) -> None:
        """Return once someone is queued for a slot."""
        ...

    async def snapshot(self) -> dict:
        """The pool's slots now (``admission_view``), for ``GET /admin/status``."""
        ...

    async def configure(self, admission: dict, tenants: list[dict]) -> None:
        """Apply a live change of the pool's admission settings and tenants (their weights,
        tiers and queue caps), keeping every lease and waiter."""
        ...


def admission_view(snap: SchedulerSnapshot) -> dict:
    """Slots in use and by whom: a request that ended and still holds a slot shows here."""
    return {
        "slots_total": snap.slots_total,
        "slots_used": snap.slots_used,
        "parked": snap.parked,
        "queued": snap.queued,
        "inflight": snap.inflight,
    }


def apply_ops(scheduler: FairScheduler, ops: Sequence[SlotOp]) -> SyncReply:
    """Apply a gateway's slot ops in the order it made them (a claim may follow the park of
    the same slot). A renewal of a lease the scheduler does not know takes it back as the
    named tenant's (``FairScheduler.renew``), unless it was released."""
    lost: list[str] = []
    for op in ops:
        kind, lease_id = op[0], op[1]
        if kind == "claim":
            known = scheduler.claim(lease_id, op[2], op[3])  # type: ignore[arg-type]
        elif kind == "park":
            known = scheduler.park(lease_id)
        elif kind == "release":
            known = scheduler.release(lease_id)
        elif kind == "renew":
            known = scheduler.renew(lease_id, tenant=op[2], tier=op[3]) is not None  # type: ignore[arg-type]
        else:
            raise ValueError(f"unknown slot op {kind!r}")
        if not known and kind != "release":
            lost.append(lease_id)
    return SyncReply(scheduler.contended, tuple(lost))


class LocalSchedulerClient:
    """A ``FairScheduler`` in this process behind the ``SchedulerClient`` seam."""

    def __init__(self, scheduler: FairScheduler, deadline_s: float) -> None:
        self.scheduler = scheduler
        self.deadline_s = deadline_s

    async def acquire(
        self,
        tenant: str,
        tier: str | None,
        ops: Sequence[SlotOp] = (),
        wait_s: float | None = None,
    ) -> Lease:
        # Ops first, so freed slots go to whoever waited longest, as a separate call would.
        apply_ops(self.scheduler, ops)
        deadline_s = self.deadline_s if wait_s is None else min(wait_s, self.deadline_s)
        grant = await self.scheduler.acquire(tenant, tier=tier, deadline_s=deadline_s)
        ttl_s = grant.expires_at - grant.granted_at
        return Lease(grant.lease_id, ttl_s, grant.waited or self.scheduler.contended)

    async def sync(self, ops: Sequence[SlotOp]) -> SyncReply:
        return apply_ops(self.scheduler, ops)

    async def until_contended(self) -> None:
        await self.scheduler.until_contended()

    async def snapshot(self) -> dict:
        return admission_view(self.scheduler.snapshot())

    async def configure(self, admission: dict, tenants: list[dict]) -> None:
        apply_settings(self.scheduler, admission, tenants)
        self.deadline_s = AdmissionConfig.model_validate(admission).deadline_s


# The pool's admission settings and the tenants, as this gateway replica serves them now.
Settings = Callable[[], tuple[dict, list[dict]]]


class ServeSchedulerClient:
    """``SchedulerClient`` over the pool's scheduler deployment (one round trip per call).

    ``settings``, where the scheduler takes its settings from the gateways (the control
    application): a scheduler that answers ``Unconfigured`` (it just started) is sent them and
    asked again, so a restart costs the first caller one more round trip, not an admission."""

    def __init__(self, handle: DeploymentHandle, settings: Settings | None = None) -> None:
        self._handle = handle
        self._settings = settings

    async def _call(self, method: str, *args):
        try:
            return await getattr(self._handle, method).remote(*args)
        except Unconfigured:
            if self._settings is None:
                raise
            await self.configure(*self._settings())
            return await getattr(self._handle, method).remote(*args)

    async def acquire(
        self,
        tenant: str,
        tier: str | None,
        ops: Sequence[SlotOp] = (),
        wait_s: float | None = None,
    ) -> Lease:
        reply = await self._call("acquire", tenant, tier, list(ops), wait_s)
        if isinstance(reply, Shed):  # a refusal crosses as a value (``SchedulerDeployment``)
            raise reply
        lease_id, ttl_s, contended = reply
        return Lease(lease_id, ttl_s, contended)

    async def sync(self, ops: Sequence[SlotOp]) -> SyncReply:
        contended, lost = await self._call("sync", list(ops))
        return SyncReply(contended, tuple(lost))

    async def until_contended(self) -> None:
        await self._handle.until_contended.remote()

    async def snapshot(self) -> dict:
        return await self._call("snapshot")

    async def configure(self, admission: dict, tenants: list[dict]) -> None:
        await self._handle.configure.remote(admission, tenants)


def apply_settings(scheduler: FairScheduler, admission: dict, tenants: list[dict]) -> None:
    """A live change of a pool's admission settings and tenants (validated before any change)."""
    config = AdmissionConfig.model_validate(admission)
    settings = scheduler_settings(config, [TenantConfig.model_validate(t) for t in tenants])
    scheduler.reconfigure(**settings)


def fair_scheduler(admission: AdmissionConfig, tenants: Iterable[TenantConfig]) -> FairScheduler:
    """A pool's ``FairScheduler`` from its validated admission config and the tenants."""
    return FairScheduler(**scheduler_settings(admission, tenants))


def scheduler_settings(admission: AdmissionConfig, tenants: Iterable[TenantConfig]) -> dict:
    """``FairScheduler``'s settings (for its constructor and ``reconfigure``)."""
    return {
        "max_inflight": admission.max_inflight,
        "default_tenant": TenantShare(queue_cap=admission.queue_cap),
        "tenants": {t.name: _share(t, admission) for t in tenants},
        "lease_ttl_s": admission.lease_ttl_s,
        "max_queued_total": admission.max_queued_total,
        "batch_every": admission.batch_every,
        "max_tenant_share": admission.max_tenant_share,
    }


def _share(tenant: TenantConfig, admission: AdmissionConfig) -> TenantShare:
    queue_cap = tenant.queue_cap if tenant.queue_cap is not None else admission.queue_cap
    return TenantShare(weight=tenant.weight, queue_cap=queue_cap, tier=tenant.tier)
