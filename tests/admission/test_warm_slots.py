"""Parked slots: several gateway replicas (``WarmSlots``) over one real ``FairScheduler``."""

from __future__ import annotations

import asyncio
import random

import pytest

from serve_app.admission import warm_slots
from serve_app.admission.client import LocalSchedulerClient, SyncReply
from serve_app.admission.scheduler import FairScheduler, Shed, TenantShare
from serve_app.admission.warm_slots import WarmSlots
from tests.doubles import Clock
from tests.polling import eventually_async


@pytest.fixture(autouse=True)
def prompt_books(monkeypatch):
    """Claims and parks reach the scheduler within 10 ms here, not a second."""
    monkeypatch.setattr(warm_slots, "BOOKS_FLUSH_S", 0.01)


def pool(max_inflight: int = 4, **kwargs) -> LocalSchedulerClient:
    scheduler = FairScheduler(max_inflight, default_tenant=TenantShare(queue_cap=64), **kwargs)
    return LocalSchedulerClient(scheduler, deadline_s=5)


def replica(client, *, tenant_cap: int = 4, keep_warm_s: float = 10.0) -> WarmSlots:
    return WarmSlots(client, tenant_cap=tenant_cap, keep_warm_s=keep_warm_s)


async def admit(slots: WarmSlots, tenant: str = "a", tier: str = "interactive"):
    return slots.take_parked(tenant, tier) or await slots.acquire(tenant, tier)


async def test_a_parked_slot_stays_in_the_budget_and_counts_against_no_tenant():
    client = pool(max_inflight=2)
    gateway = replica(client)
    lease = await admit(gateway, "a")
    gateway.release(lease.lease_id)
    await eventually_async(
        lambda: client.scheduler.snapshot().parked == 1, timeout_s=2, what="parked"
    )
    snap = client.scheduler.snapshot()
    assert snap.slots_used == 1 and snap.inflight.get("a", 0) == 0
    again = await admit(gateway, "b")
    assert again.lease_id == lease.lease_id, "the parked slot was taken, not a new one"
    await eventually_async(
        lambda: client.scheduler.snapshot().inflight.get("b") == 1, timeout_s=2, what="b"
    )


async def test_another_replica_queued_for_a_full_pool_gets_the_parked_slots_at_once():
    client = pool(max_inflight=2)
    a, b = replica(client), replica(client)
    leases = [await admit(a), await admit(a)]
    for lease in leases:
        a.release(lease.lease_id)
    assert a.parked == 2
    # B finds the pool full (both slots parked on A) and queues; A hears and gives them back.
    lease = await asyncio.wait_for(admit(b, "c"), timeout=2)
    assert a.parked == 0
    assert {t: n for t, n in client.scheduler.snapshot().inflight.items() if n} == {"c": 1}
    b.release(lease.lease_id)
    await a.aclose()
    await b.aclose()


async def test_after_news_of_a_queue_freed_slots_go_back_instead_of_parking():
    client = pool(max_inflight=1)
    a, b = replica(client), replica(client)
    held = await admit(a)
    waiting = asyncio.create_task(admit(b, "c"))
    await eventually_async(lambda: client.scheduler.contended, timeout_s=2, what="b queued")
    a.release(held.lease_id)  # A has not heard yet: parks it, and its watch fires at once
    granted = await asyncio.wait_for(waiting, timeout=2)
    assert granted.contended, "a grant after a wait says the pool was contended"
    assert a.parked == 0 and a.take_parked("a", "interactive") is None
    b.release(granted.lease_id)
    assert b.parked == 0, "within the contended hold, a freed slot goes straight back"
    await eventually_async(
        lambda: client.scheduler.slots_used == 0, timeout_s=2, what="all slots back"
    )


async def test_idle_parked_slots_go_back_after_keep_warm_s():
    client = pool()
    gateway = replica(client, keep_warm_s=0.05)
    lease = await admit(gateway)
    gateway.release(lease.lease_id)
    assert gateway.parked == 1
    await eventually_async(
        lambda: client.scheduler.slots_used == 0, timeout_s=2, what="the idle slot back"
    )
    assert gateway.parked == 0


async def test_a_tenant_at_its_cap_on_this_replica_asks_the_scheduler():
    client = pool(max_inflight=4, max_tenant_share=0.5)  # the scheduler's cap: 2
    gateway = replica(client, tenant_cap=2)
    first, second, spare = await admit(gateway), await admit(gateway), await admit(gateway, "b")
    gateway.release(spare.lease_id)
    assert gateway.take_parked("a", "interactive") is None, "a holds its cap here"
    with pytest.raises(Shed):  # and the scheduler keeps it waiting past a zero deadline
        client.deadline_s = 0
        await gateway.acquire("a", "interactive")
    gateway.release(first.lease_id)
    gateway.release(second.lease_id)


async def test_leases_the_scheduler_lost_are_dropped_from_the_park():
    client = pool()
    gateway = replica(client)
    lease = await admit(gateway)
    gateway.release(lease.lease_id)
    await eventually_async(
        lambda: client.scheduler.snapshot().parked == 1, timeout_s=2, what="parked"
    )
    client.scheduler = FairScheduler(4)  # the scheduler restarted: it knows no lease
    taken = gateway.take_parked("a", "interactive")
    assert taken is not None  # the replica cannot know yet
    gateway.release(taken.lease_id)
    await eventually_async(lambda: gateway.parked == 0, timeout_s=2, what="the lost lease dropped")


async def test_closing_a_replica_gives_its_parked_slots_back():
    client = pool()
    gateway = replica(client)
    leases = [await admit(gateway) for _ in range(3)]
    for lease in leases:
        gateway.release(lease.lease_id)
    await gateway.aclose()
    assert client.scheduler.slots_used == 0


async def test_an_unreachable_scheduler_keeps_the_ops_for_the_next_message(monkeypatch):
    monkeypatch.setattr(warm_slots, "FLUSH_S", 0.001)
    client = pool()
    gateway = replica(client, keep_warm_s=0)
    lease = await admit(gateway)
    real_sync, calls = client.sync, []

    async def broken(ops):
        calls.append(list(ops))
        raise ConnectionError("scheduler gone")

    client.sync = broken
    gateway.release(lease.lease_id)
    await eventually_async(lambda: calls, timeout_s=2, what="a sync tried")
    client.sync = real_sync
    await admit(gateway)  # the release rides on this acquire
    assert client.scheduler.slots_used == 1


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_three_replicas_never_hold_more_than_max_inflight_and_return_every_slot(seed):
    """Random traffic through three gateway replicas: the requests holding a slot never number
    more than ``max_inflight``, and every slot is back once they stop."""
    rng = random.Random(seed)
    client = pool(max_inflight=4, max_tenant_share=0.75)
    replicas = [replica(client, tenant_cap=3, keep_warm_s=rng.choice([0.01, 0.2, 5.0]))]
    replicas += [replica(client, tenant_cap=3, keep_warm_s=0.2) for _ in range(2)]
    holding, peak, served = 0, 0, 0

    async def request(i: int) -> None:
        nonlocal holding, peak, served
        # The traffic under test: random arrivals over 0.3 s and holds of up to 20 ms, against
        # real keep-warm timers (0.01 s to 5 s); what is asserted is counts, never times.
        await asyncio.sleep(rng.random() * 0.3)
        gateway = replicas[i % 3]
        try:
            lease = await admit(gateway, rng.choice("abc"))
        except Shed:
            return
        holding += 1
        peak = max(peak, holding)
        assert client.scheduler.slots_used <= 4
        await asyncio.sleep(rng.random() * 0.02)
        holding -= 1
        served += 1
        gateway.release(lease.lease_id)

    await asyncio.gather(*(request(i) for i in range(120)))
    assert peak <= 4 and served > 60
    for gateway in replicas:
        await gateway.aclose()
    await eventually_async(
        lambda: client.scheduler.slots_used == 0, timeout_s=2, what="every slot back"
    )
    assert sum(client.scheduler.snapshot().inflight.values()) == 0


async def test_sync_reply_names_lost_leases():
    client = pool()
    reply = await client.sync([("claim", "nope", "a", "interactive"), ("release", "gone")])
    assert reply == SyncReply(contended=False, lost=("nope",))


async def test_a_tenant_refused_for_a_full_queue_is_refused_here_while_the_queue_drains():
    """The flood's retries within the refusal's repeat window never reach the scheduler; the
    next one after it does, and another tenant is never refused on the flood's account."""
    clock = [0.0]
    scheduler = FairScheduler(1, default_tenant=TenantShare(queue_cap=1))
    client = LocalSchedulerClient(scheduler, deadline_s=5)
    gateway = WarmSlots(client, tenant_cap=1, keep_warm_s=0, clock=lambda: clock[0])
    asked: list[str] = []
    acquire = client.acquire

    async def counted(tenant, *args):
        asked.append(tenant)
        return await acquire(tenant, *args)

    client.acquire = counted
    held = await gateway.acquire("flood", "interactive")
    scheduler._mean_hold_s = 0.4  # the flood's holds, as observed: a 0.1 s repeat window
    queued = asyncio.create_task(gateway.acquire("flood", "interactive"))
    await eventually_async(lambda: scheduler.queued_total == 1, timeout_s=2, what="queued")
    for _ in range(3):
        with pytest.raises(Shed) as shed:
            await gateway.acquire("flood", "interactive")
        assert (shed.value.reason, shed.value.tenant) == ("queue_full", "flood")
    assert asked == ["flood", "flood", "flood"], "two repeats answered here, not asked"
    assert scheduler.snapshot().shed == {("flood", "queue_full"): 1}

    light = asyncio.create_task(gateway.acquire("light", "interactive"))
    await eventually_async(lambda: scheduler.queued_total == 2, timeout_s=2, what="light")
    assert asked[-1] == "light"
    clock[0] = 0.2  # past the window: the scheduler is asked again
    with pytest.raises(Shed):
        await gateway.acquire("flood", "interactive")
    assert asked[-1] == "flood" and len(asked) == 5
    gateway.release(held.lease_id)
    for task in (queued, light):
        task.cancel()
    await asyncio.gather(queued, light, return_exceptions=True)


class CountsSyncs(LocalSchedulerClient):
    """The in-process scheduler, recording each ``sync`` message (one per renewal batch)."""

    def __init__(self, scheduler: FairScheduler) -> None:
        super().__init__(scheduler, deadline_s=5)
        self.synced: list[list] = []

    async def sync(self, ops):
        self.synced.append(list(ops))
        return await super().sync(ops)


def on_one_clock(max_inflight: int = 4, lease_ttl_s: float = 30.0):
    """A scheduler and a gateway replica on one hand-driven clock (renewals sent by hand)."""
    clock = Clock(1000.0)
    scheduler = FairScheduler(
        max_inflight,
        default_tenant=TenantShare(queue_cap=4),
        lease_ttl_s=lease_ttl_s,
        clock=clock,
    )
    client = CountsSyncs(scheduler)
    return clock, client, WarmSlots(client, tenant_cap=4, keep_warm_s=0, clock=clock)


async def test_long_generations_keep_their_leases_with_one_call_a_period_then_lapse():
    clock, client, gateway = on_one_clock(lease_ttl_s=30)
    leases = [await admit(gateway, tenant) for tenant in "abc"]
    for lease in leases:
        gateway.keep_alive(lease.lease_id, max_life_s=300)
    for _ in range(25):  # 250 s: eight TTLs
        clock.advance(10)
        await gateway.renew_now()
        assert client.scheduler.expire_leases() == 0
    assert client.scheduler.slots_used == 3
    assert len(client.synced) == 25, "one message a period for all three leases"
    assert {op[0] for ops in client.synced for op in ops} == {"renew"}

    clock.advance(60)  # past their longest life: no longer renewed, they lapse
    await gateway.renew_now()
    assert gateway.kept_alive == 0 and len(client.synced) == 25
    clock.advance(30)
    assert client.scheduler.expire_leases() == 3


async def test_a_renewal_never_revives_a_released_lease():
    clock, client, gateway = on_one_clock()
    done, crossed, running = [await admit(gateway) for _ in range(3)]
    for lease in (done, crossed, running):
        gateway.keep_alive(lease.lease_id, max_life_s=300)
    gateway.release(done.lease_id)  # its release waits for a message: it rides on the renewal
    client.scheduler.release(crossed.lease_id)  # released there before this renewal arrived
    clock.advance(10)
    await gateway.renew_now()
    (batch,) = client.synced
    assert ("release", done.lease_id) in batch
    assert {op[1] for op in batch if op[0] == "renew"} == {crossed.lease_id, running.lease_id}
    assert client.scheduler.slots_used == 1, "only the running request's lease is held"
    gateway.release(crossed.lease_id)
    gateway.release(running.lease_id)
