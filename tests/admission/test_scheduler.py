"""Fair admission: fast path, per-tenant FIFO, weighted interleaving, shedding, leases, tiers."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from serve_app.admission.scheduler import FairScheduler, Grant, Shed, TenantShare
from tests.doubles import Clock

LONG = 60.0  # a deadline no test reaches: these tests assert order and counts, not wall-clock


async def settle() -> None:
    """Let every ready task run up to its next await (each enqueues before it first waits)."""
    for _ in range(3):
        await asyncio.sleep(0)


async def served(sched: FairScheduler, tenant: str, log: list, **kwargs) -> Grant:
    """Wait for a slot, log who got it, and free it at once, which grants the next waiter."""
    grant = await sched.acquire(tenant, deadline_s=LONG, **kwargs)
    log.append((tenant, grant.tier))
    sched.release(grant.lease_id)
    return grant


def max_run(seq: list[str], item: str) -> int:
    best = run = 0
    for x in seq:
        run = run + 1 if x == item else 0
        best = max(best, run)
    return best


async def test_fast_path_grants_a_lease_at_once():
    sched = FairScheduler(2, lease_ttl_s=30, clock=Clock(100.0))
    grant = await sched.acquire("acme", deadline_s=LONG)
    assert grant.tenant == "acme" and grant.tier == "interactive"
    assert (grant.granted_at, grant.expires_at) == (100.0, 130.0)
    assert sched.slots_used == 1 and sched.queued_total == 0


async def test_requests_of_one_tenant_are_granted_in_arrival_order():
    sched = FairScheduler(1)
    sched.configure_tenant("acme", weight=1, queue_cap=10)
    hold = await sched.acquire("acme", deadline_s=LONG)
    order: list[int] = []

    async def numbered(i: int) -> None:
        grant = await sched.acquire("acme", deadline_s=LONG)
        order.append(i)
        sched.release(grant.lease_id)

    tasks = [asyncio.create_task(numbered(i)) for i in range(6)]
    await settle()
    sched.release(hold.lease_id)
    await asyncio.gather(*tasks)
    assert order == list(range(6))
    assert sched.slots_used == 0


async def test_weights_two_to_one_share_slots_two_to_one_and_interleave():
    sched = FairScheduler(1)
    sched.configure_tenant("heavy", weight=2, queue_cap=100)
    sched.configure_tenant("light", weight=1, queue_cap=100)
    hold = await sched.acquire("other", deadline_s=LONG)
    log: list = []
    tasks = [asyncio.create_task(served(sched, "heavy", log)) for _ in range(100)]
    tasks += [asyncio.create_task(served(sched, "light", log)) for _ in range(100)]
    await settle()
    sched.release(hold.lease_id)
    await asyncio.gather(*tasks)

    contended = [tenant for tenant, _ in log[:90]]  # both tenants wait throughout these grants
    assert contended.count("heavy") == 60 and contended.count("light") == 30
    assert max_run(contended, "heavy") <= 2
    assert max_run(contended, "light") == 1
    assert len(log) == 200 and sched.slots_used == 0


async def test_a_flooding_tenant_sheds_itself_while_a_light_tenant_is_served():
    sched = FairScheduler(2)
    sched.configure_tenant("flood", weight=1, queue_cap=4)
    sched.configure_tenant("light", weight=1, queue_cap=4)
    holds = [await sched.acquire("flood", deadline_s=LONG) for _ in range(2)]
    log: list = []
    flood = [asyncio.create_task(served(sched, "flood", log)) for _ in range(20)]
    light = [asyncio.create_task(served(sched, "light", log)) for _ in range(4)]
    await settle()

    # Sixteen floods are shed at once, before any slot frees: no waiting for a full queue.
    shed = [t for t in flood if t.done()]
    assert len(shed) == 16
    assert all(isinstance(t.exception(), Shed) for t in shed)
    assert {t.exception().reason for t in shed} == {"queue_full"}
    assert sched.snapshot().queued == {"flood": 4, "light": 4}

    for hold in holds:
        sched.release(hold.lease_id)
    results = await asyncio.gather(*light)
    await asyncio.gather(*(t for t in flood if not t.done()))
    assert len(results) == 4
    assert [tenant for tenant, _ in log].count("light") == 4
    snap = sched.snapshot()
    assert snap.shed == {("flood", "queue_full"): 16}
    assert snap.granted == {"flood": 6, "light": 4}
    assert snap.slots_used == 0


async def test_a_waiter_past_its_deadline_is_shed_and_leaves_the_queue():
    sched = FairScheduler(1)
    hold = await sched.acquire("acme", deadline_s=LONG)
    with pytest.raises(Shed) as shed:
        await sched.acquire("acme", deadline_s=0.01)
    assert shed.value.reason == "deadline" and shed.value.tenant == "acme"
    assert sched.queued_total == 0
    assert sched.snapshot().queued == {"acme": 0}

    with pytest.raises(Shed, match="deadline"):
        await sched.acquire("acme", deadline_s=0)  # no time to wait at all: never queued

    sched.release(hold.lease_id)
    assert sched.slots_used == 0  # the slot went to nobody: the shed waiter is gone
    assert sched.snapshot().shed == {("acme", "deadline"): 2}


async def test_release_is_idempotent_and_ignores_unknown_leases():
    sched = FairScheduler(1)
    grant = await sched.acquire("acme", deadline_s=LONG)
    assert sched.release(grant.lease_id) is True
    assert sched.release(grant.lease_id) is False
    assert sched.release("no-such-lease") is False
    assert sched.slots_used == 0


async def test_expired_leases_are_reclaimed_counted_and_handed_to_waiters():
    clock = Clock()
    sched = FairScheduler(1, lease_ttl_s=10, clock=clock)
    grant = await sched.acquire("dead", deadline_s=LONG)
    clock.now = 5
    renewed = sched.renew(grant.lease_id)
    assert renewed is not None and renewed.expires_at == 15
    waiter = asyncio.create_task(sched.acquire("alive", deadline_s=LONG))
    await settle()

    clock.now = 12
    assert sched.expire_leases() == 0
    clock.now = 15
    assert sched.expire_leases() == 1
    got = await waiter
    assert got.tenant == "alive"
    snap = sched.snapshot()
    assert snap.expired_leases == 1 and snap.expired_by_tenant == {"dead": 1}
    assert snap.inflight == {"dead": 0, "alive": 1}
    assert sched.release(grant.lease_id) is False
    assert sched.renew(grant.lease_id) is None


async def test_a_restarted_scheduler_takes_renewed_leases_back_and_grants_none_past_the_budget():
    """Item 7 of issue 30: the old scheduler's holders renew on the new one, which learns what
    is in flight and queues newcomers until the pool is under its budget again."""
    clock = Clock()
    old = FairScheduler(2, lease_ttl_s=30, clock=clock)
    held = [await old.acquire("acme", deadline_s=LONG) for _ in range(2)]

    new = FairScheduler(2, lease_ttl_s=30, clock=clock)  # a restart: nothing known
    early = await new.acquire("beta", deadline_s=LONG)  # granted before any renewal came
    for grant in held:
        assert new.renew(grant.lease_id, tenant="acme", tier="interactive") is not None
    snap = new.snapshot()
    assert snap.slots_used == 3 and snap.inflight == {"beta": 1, "acme": 2}
    assert snap.adopted == {"acme": 2}

    waiter = asyncio.create_task(new.acquire("beta", deadline_s=LONG))
    await settle()
    new.release(early.lease_id)
    await settle()
    assert not waiter.done(), "3 held of 2: one release leaves the pool at its budget"
    new.release(held[0].lease_id)
    assert (await waiter).tenant == "beta"


async def test_a_renewal_that_crossed_its_release_does_not_bring_the_lease_back():
    clock = Clock()
    sched = FairScheduler(1, lease_ttl_s=10, clock=clock)
    grant = await sched.acquire("acme", deadline_s=LONG)
    sched.release(grant.lease_id)
    assert sched.renew(grant.lease_id, tenant="acme") is None
    assert sched.release("released-before-known") is False
    assert sched.renew("released-before-known", tenant="acme") is None
    assert sched.slots_used == 0
    clock.now = 11  # remembered for one TTL, then forgotten
    sched.expire_leases()
    assert sched.renew(grant.lease_id, tenant="acme") is not None
    assert sched.renew("unnamed-holder") is None  # a renewal naming no tenant never adopts


async def test_acquire_reclaims_expired_leases_lazily():
    clock = Clock()
    sched = FairScheduler(1, lease_ttl_s=10, clock=clock)
    await sched.acquire("dead", deadline_s=LONG)
    clock.now = 11
    grant = await sched.acquire("acme", deadline_s=LONG)  # fast path after lazy expiry
    assert grant.tenant == "acme"
    assert sched.snapshot().expired_leases == 1


async def test_a_cancelled_waiter_leaves_the_queue_and_leaks_no_slot():
    sched = FairScheduler(1)
    hold = await sched.acquire("acme", deadline_s=LONG)
    waiter = asyncio.create_task(sched.acquire("acme", deadline_s=LONG))
    await settle()
    assert sched.queued_total == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert sched.queued_total == 0
    sched.release(hold.lease_id)
    assert sched.slots_used == 0


async def test_a_grant_racing_a_cancellation_gives_the_slot_back():
    sched = FairScheduler(1)
    hold = await sched.acquire("acme", deadline_s=LONG)
    waiter = asyncio.create_task(sched.acquire("acme", deadline_s=LONG))
    await settle()
    sched.release(hold.lease_id)  # grants the waiter...
    assert sched.slots_used == 1
    waiter.cancel()  # ...whose client leaves before it could use the grant
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert sched.slots_used == 0 and sched.queued_total == 0


async def test_a_cancelled_waiter_not_yet_cleaned_up_is_skipped_by_the_next_grant():
    sched = FairScheduler(1)
    hold = await sched.acquire("acme", deadline_s=LONG)
    gone = asyncio.create_task(sched.acquire("acme", deadline_s=LONG))
    next_ = asyncio.create_task(sched.acquire("acme", deadline_s=LONG))
    await settle()
    gone.cancel()
    sched.release(hold.lease_id)  # before the cancelled task ran its cleanup
    with pytest.raises(asyncio.CancelledError):
        await gone
    grant = await next_
    assert sched.slots_used == 1
    sched.release(grant.lease_id)
    assert sched.slots_used == 0 and sched.queued_total == 0


async def test_interactive_waiters_are_granted_before_batch_waiters():
    sched = FairScheduler(1)
    sched.configure_tenant("etl", weight=1, queue_cap=10, tier="batch")
    hold = await sched.acquire("chat", deadline_s=LONG)
    log: list = []
    tasks = [asyncio.create_task(served(sched, "etl", log)) for _ in range(2)]
    tasks += [asyncio.create_task(served(sched, "chat", log)) for _ in range(2)]
    await settle()
    sched.release(hold.lease_id)
    await asyncio.gather(*tasks)
    assert [tier for _, tier in log] == ["interactive", "interactive", "batch", "batch"]


async def test_batch_gets_one_grant_in_every_n_while_both_tiers_wait():
    sched = FairScheduler(1, batch_every=5)
    sched.configure_tenant("chat", weight=1, queue_cap=100)
    sched.configure_tenant("etl", weight=1, queue_cap=100, tier="batch")
    hold = await sched.acquire("chat", deadline_s=LONG)
    log: list = []
    tasks = [asyncio.create_task(served(sched, "chat", log)) for _ in range(40)]
    tasks += [asyncio.create_task(served(sched, "etl", log)) for _ in range(40)]
    await settle()
    sched.release(hold.lease_id)
    await asyncio.gather(*tasks)
    tiers = [tier for _, tier in log[:50]]  # interactive waits throughout these grants
    assert tiers == ["interactive"] * 4 + ["batch"] + tiers[5:]
    assert tiers.count("batch") == 10
    assert max_run(tiers, "interactive") == 4


async def test_tier_may_be_chosen_per_request():
    sched = FairScheduler(1)
    grant = await sched.acquire("chat", tier="batch", deadline_s=LONG)
    assert grant.tier == "batch"
    with pytest.raises(ValueError):
        await sched.acquire("chat", tier="urgent", deadline_s=LONG)  # type: ignore[arg-type]


async def test_overload_sheds_batch_first_and_interactive_preempts_the_newest_batch():
    sched = FairScheduler(1, max_queued_total=3)
    sched.configure_tenant("etl", weight=1, queue_cap=10, tier="batch")
    sched.configure_tenant("chat", weight=1, queue_cap=10)
    await sched.acquire("chat", deadline_s=LONG)
    old_batch = asyncio.create_task(sched.acquire("etl", deadline_s=LONG))
    await settle()
    new_batch = asyncio.create_task(sched.acquire("etl", deadline_s=LONG))
    chat = [asyncio.create_task(sched.acquire("chat", deadline_s=LONG))]
    await settle()
    assert sched.queued_total == 3

    with pytest.raises(Shed) as shed:
        await sched.acquire("etl", deadline_s=LONG)
    assert shed.value.reason == "overload"

    chat.append(asyncio.create_task(sched.acquire("chat", deadline_s=LONG)))
    await settle()
    with pytest.raises(Shed) as preempted:
        await new_batch
    assert preempted.value.reason == "preempted"
    assert not old_batch.done()

    chat.append(asyncio.create_task(sched.acquire("chat", deadline_s=LONG)))
    await settle()
    with pytest.raises(Shed, match="preempted"):
        await old_batch

    with pytest.raises(Shed) as shed:  # no batch left to evict: interactive is shed too
        await sched.acquire("chat", deadline_s=LONG)
    assert shed.value.reason == "overload"

    snap = sched.snapshot()
    assert snap.queued == {"etl": 0, "chat": 3}
    assert snap.shed == {
        ("etl", "overload"): 1,
        ("etl", "preempted"): 2,
        ("chat", "overload"): 1,
    }
    for task in chat:
        task.cancel()
    await asyncio.gather(*chat, return_exceptions=True)


async def test_snapshot_reports_depths_inflight_slots_and_counters():
    sched = FairScheduler(2, default_tenant=TenantShare(weight=1, queue_cap=1))
    sched.configure_tenant("idle", weight=3, queue_cap=5)
    a = await sched.acquire("a", deadline_s=LONG)
    await sched.acquire("b", deadline_s=LONG)
    waiter = asyncio.create_task(sched.acquire("a", deadline_s=LONG))
    await settle()
    with pytest.raises(Shed):
        await sched.acquire("a", deadline_s=LONG)  # default queue_cap 1: full

    snap = sched.snapshot()
    assert (snap.slots_total, snap.slots_used) == (2, 2)
    assert snap.queued == {"idle": 0, "a": 1, "b": 0}
    assert snap.queued_total == 1
    assert snap.queued_by_tier == {"interactive": 1, "batch": 0}
    assert snap.inflight == {"idle": 0, "a": 1, "b": 1}
    assert snap.granted == {"a": 1, "b": 1}
    assert snap.shed == {("a", "queue_full"): 1}
    assert snap.expired_leases == 0 and snap.mean_hold_s is None

    sched.release(a.lease_id)
    await waiter
    snap = sched.snapshot()
    assert snap.queued["a"] == 0 and snap.inflight["a"] == 1 and snap.granted["a"] == 2
    assert snap.mean_hold_s is not None


async def test_retry_after_is_positive_and_follows_hold_time_and_queue():
    clock = Clock()
    sched = FairScheduler(2, default_tenant=TenantShare(queue_cap=3), clock=clock)
    first = await sched.acquire("t", deadline_s=LONG)
    await sched.acquire("t", deadline_s=LONG)
    with pytest.raises(Shed) as unknown:
        await sched.acquire("t", deadline_s=0)
    assert unknown.value.retry_after_s == 1.0  # no hold observed yet: the 1 s floor

    clock.now = 4.0
    sched.release(first.lease_id)  # one 4 s hold observed
    await sched.acquire("t", deadline_s=LONG)
    waiters = [asyncio.create_task(sched.acquire("t", deadline_s=LONG)) for _ in range(3)]
    await settle()
    with pytest.raises(Shed) as full:
        await sched.acquire("t", deadline_s=LONG)
    assert full.value.reason == "queue_full"
    assert full.value.retry_after_s == pytest.approx(4.0 * (3 + 1) / 2)
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)
    assert sched.queued_total == 0


def test_shed_survives_pickling_across_the_actor_boundary():
    shed = pickle.loads(pickle.dumps(Shed("queue_full", 2.5, "acme", 0.25)))
    assert (shed.reason, shed.retry_after_s, shed.tenant, shed.repeat_s) == (
        "queue_full",
        2.5,
        "acme",
        0.25,
    )


async def test_a_full_queue_may_be_refused_again_while_it_stays_half_full():
    """A tenant holding 2 slots at 0.4 s a hold turns one over every 0.2 s: its 4 queued
    requests stay at least 2 deep for 0.4 s, so gateways may refuse it themselves that long."""
    clock = Clock()
    sched = FairScheduler(2, default_tenant=TenantShare(queue_cap=4), clock=clock)
    first = await sched.acquire("flood", deadline_s=LONG)
    await sched.acquire("flood", deadline_s=LONG)
    with pytest.raises(Shed) as unknown:
        await sched.acquire("flood", deadline_s=0)  # the deadline's refusal says nothing more
    assert unknown.value.repeat_s == 0.0
    clock.now = 0.4
    sched.release(first.lease_id)  # one 0.4 s hold observed
    await sched.acquire("flood", deadline_s=LONG)
    waiters = [asyncio.create_task(sched.acquire("flood", deadline_s=LONG)) for _ in range(4)]
    await settle()
    with pytest.raises(Shed) as full:
        await sched.acquire("flood", deadline_s=LONG)
    assert full.value.reason == "queue_full"
    assert full.value.repeat_s == pytest.approx(0.4 / 2 * 4 / 2)
    for task in waiters:
        task.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


@pytest.mark.parametrize(
    "kwargs",
    [{"weight": 0}, {"weight": float("inf")}, {"queue_cap": -1}, {"tier": "urgent"}],
)
def test_tenant_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        TenantShare(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_inflight": 0},
        {"max_inflight": 1, "lease_ttl_s": 0},
        {"max_inflight": 1, "max_queued_total": -1},
        {"max_inflight": 1, "batch_every": 0},
    ],
)
def test_scheduler_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        FairScheduler(**kwargs)


async def test_tenant_share_cap_keeps_headroom_for_another_tenant():
    sched = FairScheduler(4, max_tenant_share=0.5)
    a1 = await sched.acquire("a", deadline_s=5)
    await sched.acquire("a", deadline_s=5)
    third = asyncio.ensure_future(sched.acquire("a", deadline_s=5))
    await asyncio.sleep(0)
    assert not third.done(), "a is at its cap of 2 although 2 slots are free"
    b = await asyncio.wait_for(sched.acquire("b", deadline_s=5), 1)
    assert b.tenant == "b" and sched.slots_used == 3
    sched.release(a1.lease_id)
    assert (await asyncio.wait_for(third, 1)).tenant == "a"


async def test_a_parked_slot_is_held_for_no_tenant_until_claimed_and_expires_like_any():
    clock = Clock()
    sched = FairScheduler(2, lease_ttl_s=10, clock=clock)
    grant = await sched.acquire("a", deadline_s=LONG)
    clock.now = 4
    assert sched.park(grant.lease_id)
    snap = sched.snapshot()
    assert (snap.slots_used, snap.parked, snap.inflight) == (1, 1, {"a": 0})
    assert snap.mean_hold_s == 4, "parking ends the request's hold"
    assert sched.claim(grant.lease_id, "b", "batch")
    snap = sched.snapshot()
    assert (snap.parked, snap.inflight["b"], snap.granted["b"]) == (0, 1, 1)
    assert sched.park(grant.lease_id)
    clock.now = 14
    assert sched.expire_leases() == 1, "a parked lease renews on park and expires after"
    assert sched.snapshot().parked == 0 and sched.slots_used == 0
    assert not sched.claim(grant.lease_id, "b", "batch")
    assert not sched.park(grant.lease_id)


async def test_contended_is_set_while_anyone_is_queued_and_wakes_watchers():
    sched = FairScheduler(1)
    held = await sched.acquire("a", deadline_s=LONG)
    watcher = asyncio.create_task(sched.until_contended())
    await settle()
    assert not sched.contended and not watcher.done()
    waiter = asyncio.create_task(sched.acquire("b", deadline_s=LONG))
    await settle()
    assert sched.contended and watcher.done()
    sched.release(held.lease_id)
    assert (await waiter).waited
    assert not sched.contended
