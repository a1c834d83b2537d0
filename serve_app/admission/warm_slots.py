"""Slots kept warm on a gateway replica: uncontended admission without a round trip.

A finished request's slot goes back to the pool's scheduler, unless nobody is queued there:
then this gateway replica keeps it (parks it) for its own next request, which takes it at once
and tells the scheduler afterwards (a claim, riding on the next message). A pool with free slots
thus admits in microseconds, and the scheduler's fair queues take over as soon as anyone waits:

- every answer from the scheduler says whether someone is queued, and while slots are parked a
  watch (``until_contended``) pushes it; either way every parked slot goes back and this replica
  sends its requests through the scheduler for ``CONTENDED_HOLD_S``;
- a parked slot unused for ``keep_warm_s`` goes back;
- the budget stays the scheduler's: parked slots are held leases, so ``max_inflight`` bounds
  parked plus in use across every gateway replica, and a dead replica's leases expire as before;
- a tenant takes a parked slot only while it holds fewer than its cap on this replica.

A tenant the scheduler refused for a full queue is refused here for the ``repeat_s`` the
refusal carries (a fraction of a second: its queue is still at least half full meanwhile), with
no call: a flood's retries then cost this replica no round trip and the scheduler nothing.

The price: for one round trip after a queue forms (the watch's news), this replica may still
admit from its parked slots, and on the fast path a tenant's cap is enforced per replica (the
scheduler counts claims when they arrive).

What the scheduler must hear is batched, latest op per slot: a release rides on this replica's
next acquire or goes alone after at most ``FLUSH_S`` (someone may be waiting for that slot);
claims and parks change only the scheduler's per-tenant books, not the budget, so they wait up to
``BOOKS_FLUSH_S`` (and go at once when a queue forms). A replica busy on parked slots thus makes
about one scheduler call a second, not one per request.

Renewals are batched too: every third of the lease TTL, one ``sync`` renews the lease of every
request this replica admitted and still runs (``keep_alive``), with any ops waiting, instead of
a call and a timer per stream (at 1,000 slow streams those were 2.8 % of the gateway's CPU). Each
renewal names its tenant and tier, so a scheduler that lost the lease (restarted) takes it back;
one it saw released stays released. A request's lease is renewed until it is released or its
longest life has passed (then it lapses, and the scheduler reclaims it).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections import Counter
from collections.abc import Callable, Coroutine

from serve_app.admission.client import Lease, SchedulerClient, SlotOp
from serve_app.admission.scheduler import Shed

FLUSH_S = 0.005  # longest a release waits for a ride on an acquire before it is sent alone
BOOKS_FLUSH_S = 1.0  # the same for claims and parks: the scheduler's per-tenant books
CONTENDED_HOLD_S = 1.0  # after news of a queue, this long through the scheduler only


class WarmSlots:
    """One pool's slots as seen from one gateway replica; the admission stage's only door."""

    def __init__(
        self,
        client: SchedulerClient,
        *,
        tenant_cap: int,
        keep_warm_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.tenant_cap = tenant_cap
        self.keep_warm_s = keep_warm_s
        self._clock = clock
        self._parked: dict[str, float] = {}  # lease id → when parked; oldest first
        self._lent: dict[str, tuple[str, str]] = {}  # lease id → (tenant, tier) of its request
        self._lent_to: Counter[str] = Counter()
        self._ttl_s = 0.0
        self._ops: dict[str, SlotOp] = {}  # lease id → its latest op not yet sent
        self._contended_until = 0.0
        self._flush: asyncio.TimerHandle | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._watch: asyncio.Task | None = None
        self._sending: set[asyncio.Task] = set()
        self._refused: dict[str, tuple[float, Shed]] = {}  # tenant → (until, its refusal)
        self._renew_until: dict[str, float] = {}  # lease id → when its renewals stop
        self._renewal: asyncio.TimerHandle | None = None

    # -- the admission stage's calls -------------------------------------------------------------

    def take_parked(self, tenant: str, tier: str) -> Lease | None:
        """A parked slot for ``tenant`` now, or None: ask the scheduler (``acquire``)."""
        if not self._parked or self._clock() < self._contended_until:
            return None
        if self._lent_to[tenant] >= self.tenant_cap:
            return None
        lease_id, _ = self._parked.popitem()  # the newest: its lease was renewed last
        self._lend(lease_id, tenant, tier)
        self._send_soon(("claim", lease_id, tenant, tier))
        return Lease(lease_id, self._ttl_s)

    async def acquire(self, tenant: str, tier: str, wait_s: float | None = None) -> Lease:
        """A slot from the scheduler (maybe after a wait in the tenant's queue, ``wait_s`` at
        most where given), or ``Shed`` (the scheduler's, or its refusal repeated here)."""
        refused = self._refused.get(tenant)
        if refused is not None:
            if self._clock() < refused[0]:
                shed = refused[1]  # a new one: a re-raised exception keeps growing its traceback
                raise Shed(shed.reason, shed.retry_after_s, tenant)
            del self._refused[tenant]
        ops = self._take_ops()
        try:
            lease = await self.client.acquire(tenant, tier, ops, wait_s)
        except Shed as shed:  # the ops were applied first
            if shed.repeat_s > 0:
                self._refused[tenant] = (self._clock() + shed.repeat_s, shed)
            raise
        except BaseException:
            # It may not have reached the scheduler: send the ops again (claim, park and
            # release are safe to repeat).
            self._requeue(ops)
            raise
        self._ttl_s = lease.ttl_s
        if lease.contended:
            self._on_contended()
        self._lend(lease.lease_id, tenant, tier)
        return lease

    def keep_alive(self, lease_id: str, max_life_s: float) -> None:
        """Renew a lease this replica lent a request, with all the others, until it is released
        or ``max_life_s`` has passed: a long generation keeps its slot, and a request whose end
        is somehow never seen does not hold one forever."""
        if lease_id not in self._lent:
            return
        self._renew_until[lease_id] = self._clock() + max_life_s
        self._renew_later()

    async def renew_now(self) -> None:
        """Renew every lease kept alive here in one scheduler call (``sync``, which carries the
        ops waiting too)."""
        renewals = self._renewals()
        if renewals:
            await self._sync(self._take_ops(), renewals)

    def release(self, lease_id: str) -> None:
        """The request is done with its slot: park it here, or give it back if anyone waits."""
        self._renew_until.pop(lease_id, None)
        lent = self._lent.pop(lease_id, None)
        if lent is None:
            return
        tenant = lent[0]
        self._lent_to[tenant] -= 1
        if self._lent_to[tenant] <= 0:
            del self._lent_to[tenant]
        now = self._clock()
        if self.keep_warm_s > 0 and now >= self._contended_until:
            self._parked[lease_id] = now
            self._send_soon(("park", lease_id))
            self._watch_for_queues()
            self._sweep_later(self.keep_warm_s)
        else:
            self._send_soon(("release", lease_id))

    async def aclose(self) -> None:
        """Give every parked slot back (a replica shutting down) and stop watching."""
        if self._watch is not None:
            self._watch.cancel()
        self._give_back_parked()
        ops = self._take_ops()
        if ops:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.sync(ops), 2.0)

    @property
    def parked(self) -> int:
        return len(self._parked)

    @property
    def kept_alive(self) -> int:
        """Leases renewed here: their requests are neither released nor past their life."""
        return len(self._renew_until)

    # -- internals -------------------------------------------------------------------------------

    def _lend(self, lease_id: str, tenant: str, tier: str) -> None:
        self._lent[lease_id] = (tenant, tier)
        self._lent_to[tenant] += 1

    def _renew_later(self) -> None:
        if self._renewal is None:
            period_s = max(0.1, self._ttl_s / 3)
            # In no request's context: Serve cancels a request's handle calls with it, and
            # this one call renews every request's lease.
            self._renewal = asyncio.get_running_loop().call_later(
                period_s, self._renew_due, context=contextvars.Context()
            )

    def _renew_due(self) -> None:
        self._renewal = None
        if self._renew_until:
            self._spawn(self.renew_now())
            self._renew_later()

    def _renewals(self) -> list[SlotOp]:
        """A renew op per lease kept alive; leases past their life stop here (and lapse)."""
        now = self._clock()
        lapsed = [lease_id for lease_id, until in self._renew_until.items() if until <= now]
        for lease_id in lapsed:
            del self._renew_until[lease_id]
        return [("renew", lease_id, *self._lent[lease_id]) for lease_id in self._renew_until]

    def _send_soon(self, op: SlotOp) -> None:
        self._ops[op[1]] = op  # only the latest op on a slot matters: it says where it is now
        delay = FLUSH_S if op[0] == "release" else BOOKS_FLUSH_S
        loop = asyncio.get_running_loop()
        if self._flush is None or self._flush.when() > loop.time() + delay:
            if self._flush is not None:
                self._flush.cancel()
            self._flush = loop.call_later(delay, self._send_now)

    def _take_ops(self) -> list[SlotOp]:
        ops = list(self._ops.values())
        self._ops.clear()
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        return ops

    def _requeue(self, ops: list[SlotOp]) -> None:
        """Ops that may not have arrived, behind any made since (those are newer)."""
        older = {op[1]: op for op in ops if op[1] not in self._ops}
        self._ops = {**older, **self._ops}

    def _send_now(self) -> None:
        self._flush = None
        ops = self._take_ops()
        if ops:
            self._spawn(self._sync(ops))

    def _spawn(self, message: Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(message)
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _sync(self, ops: list[SlotOp], renewals: list[SlotOp] | None = None) -> None:
        try:
            reply = await self.client.sync([*ops, *renewals] if renewals else ops)
        except Exception:
            # Unreachable: keep the ops for the next message (the renewals are made afresh
            # next period); the leases expire if none ever comes, and come back on renewal.
            self._requeue(ops)
            return
        for lease_id in reply.lost:
            self._parked.pop(lease_id, None)
        if reply.contended:
            self._on_contended()

    def _on_contended(self) -> None:
        self._contended_until = self._clock() + CONTENDED_HOLD_S
        self._give_back_parked()
        self._send_now()  # the books too: the scheduler now picks by them

    def _give_back_parked(self) -> None:
        for lease_id in self._parked:
            self._ops[lease_id] = ("release", lease_id)
        self._parked.clear()

    def _watch_for_queues(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._watch_queues())

    async def _watch_queues(self) -> None:
        try:
            await self.client.until_contended()
        except Exception:
            return  # unreachable: parked slots still go back after keep_warm_s
        self._on_contended()

    def _sweep_later(self, delay_s: float) -> None:
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(delay_s, self._sweep_idle)

    def _sweep_idle(self) -> None:
        """Give back slots parked longer than ``keep_warm_s``; come back for the rest."""
        self._sweep = None
        cutoff = self._clock() - self.keep_warm_s
        stale = [lease_id for lease_id, since in self._parked.items() if since <= cutoff]
        for lease_id in stale:
            del self._parked[lease_id]
            self._ops[lease_id] = ("release", lease_id)
        if stale:
            self._send_now()
        if self._parked:
            oldest = next(iter(self._parked.values()))
            self._sweep_later(max(0.001, oldest + self.keep_warm_s - self._clock()))
