"""Fair admission: the slot budget of one backend pool, handed out fairly between tenants.

GPU batch capacity is the scarce resource, so the gateway asks for a slot before it dispatches.
``FairScheduler`` is the pure logic (no Ray, no threads): every method is sync or ``async`` on one
asyncio event loop, the loop of the actor that wraps it. Waiters await futures that ``release``
and ``expire_leases`` resolve; nothing polls.

Admission, in order:

1. **Fast path**: a free slot and nobody waiting → a lease at once.
2. **Tenant cap**: each tenant has one bounded FIFO queue (``queue_cap`` waiting requests, across
   both tiers). Full → ``Shed("queue_full")`` at once: a flooding tenant sheds itself, and
   queueing beyond capacity would add latency, never throughput.
3. **Global cap** (``max_queued_total``, optional): when the pool's queues together are full, a
   batch arrival is shed (``"overload"``); an interactive arrival evicts the newest queued batch
   request (which gets ``Shed("preempted")``) and takes its place, or is shed (``"overload"``)
   when no batch request is queued.
4. **Deadline**: a request not granted within ``deadline_s`` leaves its queue and gets
   ``Shed("deadline")``; nothing is served late without bound.

Headroom (``max_tenant_share``, default 1.0): no tenant holds more than
``floor(max_inflight * max_tenant_share)`` slots at once; beyond that its requests wait in its
queue even while slots are free. Generations of one size finish together, so without headroom a
flooder's queued requests take every slot the moment a batch ends and a light tenant arriving a
moment later waits a whole generation. With a share below 1, slots stay free for other tenants
to start at once; the price is the idle headroom while one tenant is alone.

Handing out a freed slot:

- **Tier first.** Interactive waiters are granted before batch waiters, with one anti-starvation
  rule: *while both tiers wait, every N-th grant goes to batch* (``batch_every``, default 5). After
  N−1 consecutive interactive grants made while batch waited, the next grant goes to batch. So
  under sustained contention batch gets exactly 1/N of the grants and interactive (N−1)/N; with
  only one tier waiting, that tier gets every slot.
- **Then tenant, by smooth weighted round robin** (nginx's algorithm) over the tenants of that tier
  that have waiters: each adds its ``weight`` to its ``current``, the largest ``current`` wins
  (ties go to the tenant that started waiting first) and pays back the total weight of the
  tenants considered. Weights 2:1 give A A B A A B…, interleaved rather than bursty. A tenant whose
  queue empties leaves the rotation and its ``current`` is forgotten, so idling banks no credit.
- **Then FIFO** within the tenant's queue.

Leases: a grant is a lease with a TTL (``lease_ttl_s``). The holder releases it on every exit
path (``release`` is idempotent) and renews it while a long generation runs; ``expire_leases``,
called periodically by the wrapper and lazily on ``acquire``, reclaims the slots of holders that
died and counts them. A waiter cancelled while waiting (the client went away) leaves its queue;
one cancelled just after its grant releases the slot it was given, so no path leaks a slot.

Leases are reconstructible: a renewal names the lease's tenant and tier, and a renewal of a lease
the scheduler does not know (it restarted, or expired the lease while its holder lived) takes it
back as held. A new scheduler so learns what is in flight within one renewal period (a third of
the TTL); until then it may grant slots the lease holders already use, and afterwards it grants
none until the pool is under its budget again. A lease released here, or released before it was
known, is remembered for one TTL, so a renewal that crossed its release cannot bring it back.

Retry-After: ``retry_after_s = max(1, mean_hold_s * (queued_total + 1) / max_inflight)``: the time
the pool needs to work through everything queued now plus this request, at its observed turnover
rate of ``max_inflight / mean_hold_s`` grants per second. ``mean_hold_s`` is an exponentially
weighted mean (α = 0.2) of the hold times of released leases (expired leases are dead holders, not
hold times, and are left out); 1 s until the first release. The 1 s floor matches HTTP's
whole-second ``Retry-After`` and keeps a shed client from retrying hot.

Refusals repeated by the gateway: a tenant refused for a full queue is refused again by the
gateway replica itself for ``refusal_repeat_s`` (about the time its queue needs to drain to half),
so a flood's retries cost one scheduler call per window instead of one each, and the tenant's
slots never sit idle for it. Refusals travel to the gateway as returned values, not raised
exceptions (``deployment.py`` says why).

Parked slots: a gateway replica may keep a slot it has finished with for its next request
instead of handing it back (``park``), and later give it to that request's tenant (``claim``), so
an uncontended pool admits without a round trip to the scheduler. A parked slot stays in the
budget (``max_inflight`` still bounds parked + held), counts against no tenant, and renews its
lease; ``contended`` (someone is queued) and ``until_contended`` tell holders to hand parked
slots back. The gateway side is ``serve_app/admission/warm_slots.py``.

Which tier a request runs at (the tenant's own, or a request header when the tenant may choose) is
the gateway's decision; the scheduler takes the answer as ``acquire(..., tier=...)``.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

Tier = Literal["interactive", "batch"]
ShedReason = Literal["queue_full", "deadline", "overload", "preempted"]

TIERS: tuple[Tier, ...] = ("interactive", "batch")
PARKED = ""  # the tenant of a slot parked on a gateway replica between two requests
HOLD_EWMA_ALPHA = 0.2
UNKNOWN_HOLD_S = 1.0
MIN_RETRY_AFTER_S = 1.0
MAX_REFUSAL_REPEAT_S = 1.0  # never past the Retry-After floor


def tenant_cap(max_inflight: int, max_tenant_share: float) -> int:
    """Slots one tenant may hold at once: the rest is headroom for another tenant to start."""
    return max(1, math.floor(max_inflight * max_tenant_share))


@dataclass(frozen=True)
class TenantShare:
    """How a tenant shares the pool: its weight, how many of its requests may wait, its tier."""

    weight: float = 1.0
    queue_cap: int = 8
    tier: Tier = "interactive"

    def __post_init__(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"weight must be a finite number > 0, got {self.weight!r}")
        if self.queue_cap < 0:
            raise ValueError(f"queue_cap must be >= 0, got {self.queue_cap!r}")
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")


@dataclass(frozen=True)
class Grant:
    """A lease on one slot, on the scheduler's clock. Release it on every exit path."""

    lease_id: str
    tenant: str
    tier: Tier
    granted_at: float
    expires_at: float
    waited: bool = False  # granted from a queue, not at once


class Shed(Exception):
    """The request was not admitted; the gateway answers 429 with ``Retry-After``.

    ``repeat_s``: how long a gateway may give the tenant the same answer without asking again
    (``refusal_repeat_s``); 0 where the refusal says nothing about the next request."""

    def __init__(
        self, reason: ShedReason, retry_after_s: float, tenant: str = "", repeat_s: float = 0.0
    ) -> None:
        super().__init__(f"shed ({reason}) for tenant {tenant!r}, retry after {retry_after_s:.1f}s")
        self.reason = reason
        self.retry_after_s = retry_after_s
        self.tenant = tenant
        self.repeat_s = repeat_s

    def __reduce__(self):
        # Made inside the scheduler replica and raised in the gateway: pickle every field.
        return (Shed, (self.reason, self.retry_after_s, self.tenant, self.repeat_s))


@dataclass(frozen=True)
class SchedulerSnapshot:
    """Point-in-time numbers for metrics; counters are cumulative since the scheduler started."""

    slots_total: int
    slots_used: int  # parked slots included: they are held
    parked: int
    queued: dict[str, int]
    inflight: dict[str, int]
    queued_by_tier: dict[str, int]
    granted: dict[str, int]
    shed: dict[tuple[str, str], int]
    expired_leases: int
    expired_by_tenant: dict[str, int]
    mean_hold_s: float | None
    adopted: dict[str, int] = field(default_factory=dict)  # leases taken back on renewal

    @property
    def queued_total(self) -> int:
        return sum(self.queued.values())


@dataclass(eq=False)
class _Waiter:
    tenant: str
    tier: Tier
    seq: int
    future: asyncio.Future[Grant]
    timer: asyncio.TimerHandle | None = field(default=None)


class FairScheduler:
    """Per-tenant bounded queues in front of ``max_inflight`` slots; see the module docstring."""

    def __init__(
        self,
        max_inflight: int,
        *,
        default_tenant: TenantShare | None = None,
        tenants: Mapping[str, TenantShare] | None = None,
        lease_ttl_s: float = 30.0,
        max_queued_total: int | None = None,
        batch_every: int = 5,
        max_tenant_share: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._seen: dict[str, None] = {}  # ordered set, for snapshots

        # Only tenants with waiters have a deque (insertion order = order they began waiting).
        self._queues: dict[Tier, dict[str, deque[_Waiter]]] = {t: {} for t in TIERS}
        self._current: dict[Tier, dict[str, float]] = {t: {} for t in TIERS}
        self._queued_tenant: Counter[str] = Counter()
        self._queued_tier: Counter[str] = Counter()
        self._interactive_streak = 0  # interactive grants made in a row while batch waited
        self._seq = 0

        self._leases: dict[str, Grant] = {}
        self._released: dict[str, float] = {}  # lease id → when released: never taken back
        self._parked = 0
        self._contended = asyncio.Event()  # set while anyone is queued
        self._inflight: Counter[str] = Counter()
        self._next_expiry = math.inf  # a lower bound on the earliest lease expiry

        self._granted: Counter[str] = Counter()
        self._shed: Counter[tuple[str, str]] = Counter()
        self._expired: Counter[str] = Counter()
        self._adopted: Counter[str] = Counter()
        self._mean_hold_s: float | None = None
        self.reconfigure(
            max_inflight,
            default_tenant=default_tenant,
            tenants=tenants,
            lease_ttl_s=lease_ttl_s,
            max_queued_total=max_queued_total,
            batch_every=batch_every,
            max_tenant_share=max_tenant_share,
        )

    def reconfigure(
        self,
        max_inflight: int,
        *,
        default_tenant: TenantShare | None = None,
        tenants: Mapping[str, TenantShare] | None = None,
        lease_ttl_s: float = 30.0,
        max_queued_total: int | None = None,
        batch_every: int = 5,
        max_tenant_share: float = 1.0,
    ) -> None:
        """Apply new settings to a running scheduler (a live configuration change).

        Every lease and every waiter stays: a larger budget grants waiters at once, a smaller
        one takes effect as held slots come back (no lease is revoked). Tenants not listed fall
        back to the default share; a lease keeps the expiry it was given, its renewals use the
        new TTL. Invalid settings raise before anything changes.
        """
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight!r}")
        if not lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s!r}")
        if max_queued_total is not None and max_queued_total < 0:
            raise ValueError(f"max_queued_total must be >= 0 or None, got {max_queued_total!r}")
        if batch_every < 1:
            raise ValueError(f"batch_every must be >= 1, got {batch_every!r}")
        if not 0 < max_tenant_share <= 1:
            raise ValueError(f"max_tenant_share must be in (0, 1], got {max_tenant_share!r}")
        self.tenant_cap = tenant_cap(max_inflight, max_tenant_share)
        self.max_inflight = max_inflight
        self.lease_ttl_s = lease_ttl_s
        self.max_queued_total = max_queued_total
        self.batch_every = batch_every
        self._default = default_tenant or TenantShare()
        self._tenants: dict[str, TenantShare] = dict(tenants or {})
        for name in self._tenants:
            self._seen.setdefault(name, None)
        self._dispatch()

    # -- tenants ---------------------------------------------------------------------------------

    def configure_tenant(
        self, name: str, weight: float = 1.0, queue_cap: int = 8, tier: Tier = "interactive"
    ) -> TenantShare:
        """Register or update a tenant. Applies to the next pick and the next arrival."""
        config = TenantShare(weight=weight, queue_cap=queue_cap, tier=tier)
        self._tenants[name] = config
        self._seen.setdefault(name, None)
        return config

    def tenant_config(self, name: str) -> TenantShare:
        return self._tenants.get(name, self._default)

    # -- admission -------------------------------------------------------------------------------

    async def acquire(self, tenant: str, *, tier: Tier | None = None, deadline_s: float) -> Grant:
        """Wait for a slot for ``tenant``, or raise ``Shed``. ``tier`` overrides the tenant's."""
        config = self.tenant_config(tenant)
        tier = tier or config.tier
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        self._seen.setdefault(tenant, None)
        now = self._clock()
        if now >= self._next_expiry:
            self.expire_leases(now)

        # Invariant (kept by _dispatch): a free slot never coexists with an eligible waiter, so
        # a free slot here is this tenant's to take if it is under its cap.
        if len(self._leases) < self.max_inflight and self._inflight[tenant] < self.tenant_cap:
            return self._lease(tenant, tier, now)

        if deadline_s <= 0:
            raise self._shed_now(tenant, "deadline")
        if self._queued_tenant[tenant] >= config.queue_cap:
            raise self._shed_now(tenant, "queue_full")
        if self.max_queued_total is not None and self.queued_total >= self.max_queued_total:
            victim = self._newest_batch_waiter() if tier == "interactive" else None
            if victim is None:
                raise self._shed_now(tenant, "overload")
            self._remove(victim)
            if not victim.future.done():  # a cancelled victim just leaves
                victim.future.set_exception(self._shed_now(victim.tenant, "preempted"))

        loop = asyncio.get_running_loop()
        waiter = _Waiter(tenant, tier, self._seq, loop.create_future())
        self._seq += 1
        self._enqueue(waiter)
        waiter.timer = loop.call_later(deadline_s, self._on_deadline, waiter)
        self._dispatch()  # a slot may be free that only this tenant's cap kept it from
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._on_cancelled(waiter)
            raise

    def release(self, lease_id: str) -> bool:
        """Free a lease's slot. Idempotent: an unknown or already freed lease returns False."""
        self._released.pop(lease_id, None)  # oldest first: forgetting stops at the first young
        self._released[lease_id] = self._clock()
        grant = self._leases.pop(lease_id, None)
        if grant is None:
            return False
        self._vacate(grant, hold_ended=True)
        self._dispatch()
        return True

    def park(self, lease_id: str) -> bool:
        """Keep a finished request's slot for its gateway replica's next request: it stays held,
        counts against no tenant, and its lease is renewed. False if the lease is unknown."""
        grant = self._leases.get(lease_id)
        if grant is None:
            return False
        self._vacate(grant, hold_ended=True)
        self._parked += 1
        now = self._clock()
        self._leases[lease_id] = Grant(lease_id, PARKED, grant.tier, now, now + self.lease_ttl_s)
        self._next_expiry = min(self._next_expiry, now + self.lease_ttl_s)
        return True

    def claim(self, lease_id: str, tenant: str, tier: Tier) -> bool:
        """Give a parked slot to ``tenant``'s request (admitted already, on its gateway replica);
        False if the lease is unknown (expired, or the scheduler restarted)."""
        grant = self._leases.get(lease_id)
        if grant is None:
            return False
        self._vacate(grant, hold_ended=False)
        self._seen.setdefault(tenant, None)
        now = self._clock()
        self._leases[lease_id] = Grant(lease_id, tenant, tier, now, now + self.lease_ttl_s)
        self._inflight[tenant] += 1
        self._granted[tenant] += 1
        return True

    @property
    def contended(self) -> bool:
        """Someone is queued: parked slots should come back."""
        return self._contended.is_set()

    async def until_contended(self) -> None:
        """Return once someone is queued (at once if someone is now)."""
        await self._contended.wait()

    def renew(
        self,
        lease_id: str,
        now: float | None = None,
        *,
        tenant: str | None = None,
        tier: Tier = "interactive",
    ) -> Grant | None:
        """Push a lease's expiry to ``now + lease_ttl_s``. A lease this scheduler does not know
        is taken back as ``tenant``'s when one is named (see the module docstring), unless it
        was released; None if it is not held."""
        now = self._clock() if now is None else now
        grant = self._leases.get(lease_id)
        if grant is None:
            if tenant is None or lease_id in self._released:
                return None
            return self._adopt(lease_id, tenant, tier, now)
        grant = replace(grant, expires_at=now + self.lease_ttl_s)
        self._leases[lease_id] = grant
        return grant

    def _adopt(self, lease_id: str, tenant: str, tier: Tier, now: float) -> Grant:
        grant = Grant(lease_id, tenant, tier, now, now + self.lease_ttl_s)
        self._leases[lease_id] = grant
        self._seen.setdefault(tenant, None)
        self._inflight[tenant] += 1
        self._adopted[tenant] += 1
        self._next_expiry = min(self._next_expiry, grant.expires_at)
        return grant

    def expire_leases(self, now: float | None = None) -> int:
        """Reclaim the slots of leases past their expiry (dead holders); returns how many."""
        now = self._clock() if now is None else now
        expired = [g for g in self._leases.values() if g.expires_at <= now]
        while self._released:
            lease_id, at = next(iter(self._released.items()))
            if at > now - self.lease_ttl_s:
                break
            del self._released[lease_id]
        for grant in expired:
            del self._leases[grant.lease_id]
            self._vacate(grant, hold_ended=False)
            self._expired[grant.tenant or "(parked)"] += 1
        self._next_expiry = min((g.expires_at for g in self._leases.values()), default=math.inf)
        if expired:
            self._dispatch()
        return len(expired)

    # -- observability ---------------------------------------------------------------------------

    @property
    def slots_used(self) -> int:
        return len(self._leases)

    @property
    def queued_total(self) -> int:
        return sum(self._queued_tier.values())

    @property
    def parked(self) -> int:
        return self._parked

    def queued_by_tenant(self) -> dict[str, int]:
        """Waiting requests of the tenants that have any (cheap at any number of tenants)."""
        return dict(self._queued_tenant)

    def retry_after_s(self) -> float:
        """Seconds until the pool could serve one more request; see the module docstring."""
        mean_hold = UNKNOWN_HOLD_S if self._mean_hold_s is None else self._mean_hold_s
        estimate = mean_hold * (self.queued_total + 1) / self.max_inflight
        return max(MIN_RETRY_AFTER_S, estimate)

    def snapshot(self) -> SchedulerSnapshot:
        tenants = list(self._seen)
        return SchedulerSnapshot(
            slots_total=self.max_inflight,
            slots_used=self.slots_used,
            parked=self._parked,
            queued={t: self._queued_tenant[t] for t in tenants},
            inflight={t: self._inflight[t] for t in tenants},
            queued_by_tier={t: self._queued_tier[t] for t in TIERS},
            granted=dict(self._granted),
            shed=dict(self._shed),
            expired_leases=sum(self._expired.values()),
            expired_by_tenant=dict(self._expired),
            mean_hold_s=self._mean_hold_s,
            adopted=dict(self._adopted),
        )

    # -- internals -------------------------------------------------------------------------------

    def _lease(self, tenant: str, tier: Tier, now: float, waited: bool = False) -> Grant:
        grant = Grant(uuid.uuid4().hex, tenant, tier, now, now + self.lease_ttl_s, waited)
        self._leases[grant.lease_id] = grant
        self._inflight[tenant] += 1
        self._granted[tenant] += 1
        self._next_expiry = min(self._next_expiry, grant.expires_at)
        return grant

    def _vacate(self, grant: Grant, *, hold_ended: bool) -> None:
        """Stop counting ``grant`` where it counted: as parked, or against its tenant (whose
        hold time feeds ``retry_after_s`` when the request ended rather than died)."""
        if grant.tenant == PARKED:
            self._parked -= 1
            return
        self._drop_inflight(grant.tenant)
        if hold_ended:
            self._note_hold(grant)

    def _note_hold(self, grant: Grant) -> None:
        hold = max(0.0, self._clock() - grant.granted_at)
        if self._mean_hold_s is None:
            self._mean_hold_s = hold
        else:
            self._mean_hold_s += HOLD_EWMA_ALPHA * (hold - self._mean_hold_s)

    def _drop_inflight(self, tenant: str) -> None:
        self._inflight[tenant] -= 1
        if self._inflight[tenant] <= 0:
            del self._inflight[tenant]

    def _shed_now(self, tenant: str, reason: ShedReason) -> Shed:
        self._shed[(tenant, reason)] += 1
        repeat_s = self.refusal_repeat_s(tenant) if reason == "queue_full" else 0.0
        return Shed(reason, self.retry_after_s(), tenant, repeat_s)

    def refusal_repeat_s(self, tenant: str) -> float:
        """How long ``tenant``'s full queue stays at least half full at its own turnover
        (``inflight / mean_hold_s`` grants a second): while it does, a gateway may refuse the
        tenant's next requests itself. The tenant loses no slot by it (its queue never runs
        dry), and a flood's repeats cost the scheduler nothing. 0 before the first hold time."""
        if self._mean_hold_s is None:
            return 0.0
        queued = self._queued_tenant[tenant]
        turnover_s = self._mean_hold_s / max(1, self._inflight[tenant])
        return min(MAX_REFUSAL_REPEAT_S, turnover_s * queued / 2)

    def _enqueue(self, waiter: _Waiter) -> None:
        self._queues[waiter.tier].setdefault(waiter.tenant, deque()).append(waiter)
        self._queued_tenant[waiter.tenant] += 1
        self._queued_tier[waiter.tier] += 1
        self._contended.set()

    def _remove(self, waiter: _Waiter) -> None:
        """Take a waiter out of its queue (from anywhere in it); leaves its future alone."""
        queues = self._queues[waiter.tier]
        queue = queues[waiter.tenant]
        if queue[0] is waiter:
            queue.popleft()
        else:
            queue.remove(waiter)
        if not queue:
            # The tenant stops waiting in this tier: out of the rotation, with no banked credit.
            del queues[waiter.tenant]
            self._current[waiter.tier].pop(waiter.tenant, None)
        self._queued_tenant[waiter.tenant] -= 1
        if self._queued_tenant[waiter.tenant] <= 0:
            del self._queued_tenant[waiter.tenant]
        self._queued_tier[waiter.tier] -= 1
        if self.queued_total == 0:
            self._contended.clear()
        if waiter.timer is not None:
            waiter.timer.cancel()

    def _newest_batch_waiter(self) -> _Waiter | None:
        tails = [queue[-1] for queue in self._queues["batch"].values()]
        return max(tails, key=lambda w: w.seq, default=None)

    def _eligible(self, tier: Tier) -> Iterator[str]:
        """Tenants of ``tier`` with waiters and a slot to spare under their cap."""
        cap = self.tenant_cap
        return (t for t in self._queues[tier] if self._inflight[t] < cap)

    def _pick_tier(self) -> Tier | None:
        interactive = next(self._eligible("interactive"), None) is not None
        batch = next(self._eligible("batch"), None) is not None
        if not interactive and not batch:
            return None
        if not batch:
            self._interactive_streak = 0
            return "interactive"
        if not interactive or self._interactive_streak >= self.batch_every - 1:
            self._interactive_streak = 0
            return "batch"
        self._interactive_streak += 1
        return "interactive"

    def _pick_tenant(self, tier: Tier) -> str:
        """Smooth weighted round robin over the tenants of ``tier`` that have waiters."""
        current = self._current[tier]
        best: str | None = None
        total = 0.0
        for tenant in self._eligible(tier):
            weight = self.tenant_config(tenant).weight
            total += weight
            current[tenant] = current.get(tenant, 0.0) + weight
            if best is None or current[tenant] > current[best]:
                best = tenant
        assert best is not None
        current[best] -= total
        return best

    def _dispatch(self) -> None:
        """Hand free slots to waiters, one pick at a time."""
        while len(self._leases) < self.max_inflight and self.queued_total > 0:
            tier = self._pick_tier()
            if tier is None:  # every waiter's tenant is at its cap
                return
            tenant = self._pick_tenant(tier)
            waiter = self._queues[tier][tenant][0]
            self._remove(waiter)
            if waiter.future.done():
                # Cancelled, and its task has not run its cleanup yet: it just leaves the queue.
                continue
            waiter.future.set_result(self._lease(tenant, tier, self._clock(), waited=True))

    def _on_deadline(self, waiter: _Waiter) -> None:
        if waiter.future.done():
            return
        self._remove(waiter)
        waiter.future.set_exception(self._shed_now(waiter.tenant, "deadline"))

    def _on_cancelled(self, waiter: _Waiter) -> None:
        future = waiter.future
        if not future.done() or future.cancelled():
            if waiter in self._queues[waiter.tier].get(waiter.tenant, ()):
                self._remove(waiter)
            return
        if future.exception() is None:
            # The grant raced the cancellation: nobody will use this slot, so give it back.
            self.release(future.result().lease_id)
