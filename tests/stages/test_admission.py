"""The admission stage over a real in-process scheduler: grants, sheds, releases, fails open."""

from __future__ import annotations

import pytest
from starlette.requests import Request
from starlette.responses import Response

from serve_app.admission import warm_slots
from serve_app.admission.client import Lease, LocalSchedulerClient
from serve_app.admission.scheduler import FairScheduler, Shed, TenantShare
from serve_app.admission.warm_slots import WarmSlots
from serve_app.config.models import TenantConfig
from serve_app.errors import ForgeError
from serve_app.pipeline import RequestContext
from serve_app.protocol import ChatCompletionRequest
from serve_app.stages.admission import AdmissionStage
from tests.doubles import Clock, RecordingMetrics
from tests.polling import eventually_async

MODEL = "forge-sim"


class RecordingScheduler(LocalSchedulerClient):
    """The real in-process scheduler client, recording what the stage asks of it; ``fail``
    makes the next acquire raise it instead (a shed, an unreachable scheduler)."""

    def __init__(self, max_inflight: int = 4) -> None:
        super().__init__(
            FairScheduler(max_inflight, default_tenant=TenantShare(queue_cap=4)), deadline_s=5
        )
        self.acquired: list[tuple[str, str | None, list]] = []
        self.granted: list[str] = []
        self.synced: list[list] = []
        self.fail: BaseException | None = None

    async def acquire(self, tenant, tier, ops=(), wait_s=None) -> Lease:
        self.acquired.append((tenant, tier, list(ops)))
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        lease = await super().acquire(tenant, tier, ops, wait_s)
        self.granted.append(lease.lease_id)
        return lease

    async def sync(self, ops):
        self.synced.append(list(ops))
        return await super().sync(ops)

    @property
    def slots_used(self) -> int:
        return self.scheduler.snapshot().slots_used


def ctx_for(tenant: str, headers: dict | None = None) -> RequestContext:
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": raw})
    ctx = RequestContext(request, "chat")
    ctx.tenant = TENANTS[tenant]
    ctx.parsed = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x"}])
    return ctx


TENANTS = {
    "a": TenantConfig(name="a", key_hashes=["a" * 64]),
    "b": TenantConfig(name="b", key_hashes=["b" * 64], tier="batch", allow_priority_header=True),
}


def stage(
    scheduler: RecordingScheduler,
    metrics: RecordingMetrics | None = None,
    keep_warm_s: float = 10.0,
) -> AdmissionStage:
    slots = WarmSlots(scheduler, tenant_cap=4, keep_warm_s=keep_warm_s)
    return AdmissionStage({MODEL: slots}, {MODEL: 5.0}, metrics or RecordingMetrics())


async def ok(ctx: RequestContext) -> Response:
    return Response(b"{}")


async def test_a_finished_slot_is_parked_and_the_next_request_takes_it_without_a_call(
    monkeypatch,
):
    monkeypatch.setattr(warm_slots, "BOOKS_FLUSH_S", 0.01)
    scheduler = RecordingScheduler()
    admission = stage(scheduler)
    assert (await admission(ctx_for("a"), ok)).status_code == 200
    assert (await admission(ctx_for("b"), ok)).status_code == 200
    assert len(scheduler.acquired) == 1, "the second request asked nobody"
    first = scheduler.granted[0]
    await eventually_async(
        lambda: scheduler.synced, timeout_s=2, what="the scheduler told where the slot is"
    )
    assert scheduler.synced == [[("park", first)]], "one message: the slot's latest state"
    assert scheduler.slots_used == 1  # parked on this replica, still in the budget
    assert scheduler.scheduler.snapshot().parked == 1


async def test_without_keep_warm_every_request_asks_and_a_quiet_gateway_releases_on_its_own():
    scheduler = RecordingScheduler()
    admission = stage(scheduler, keep_warm_s=0)
    await admission(ctx_for("a"), ok)
    assert scheduler.slots_used == 1
    await eventually_async(lambda: scheduler.slots_used == 0, timeout_s=2, what="the slot freed")
    await admission(ctx_for("a"), ok)
    assert len(scheduler.acquired) == 2


async def test_a_release_rides_on_the_next_acquire(monkeypatch):
    monkeypatch.setattr(warm_slots, "FLUSH_S", 60)  # only the piggyback path
    scheduler = RecordingScheduler()
    admission = stage(scheduler, keep_warm_s=0)
    await admission(ctx_for("a"), ok)
    await admission(ctx_for("a"), ok)
    first = scheduler.granted[0]
    assert scheduler.acquired[1][2] == [("release", first)], "the release rode on the call"
    assert scheduler.synced == [], "no call of its own"
    assert scheduler.slots_used == 1  # only the second request's slot is still held


async def test_shed_is_a_429_with_retry_after_and_counted():
    scheduler, metrics = RecordingScheduler(), RecordingMetrics()
    scheduler.fail = Shed("queue_full", 2.2, "a")
    with pytest.raises(ForgeError) as info:
        await stage(scheduler, metrics)(ctx_for("a"), ok)
    assert info.value.status == 429 and info.value.headers["retry-after"] == "3"
    assert metrics.shed.calls == [{"tenant": "a", "reason": "queue_full"}]


async def test_scheduler_unreachable_admits_and_counts():
    scheduler, metrics = RecordingScheduler(), RecordingMetrics()
    scheduler.fail = ConnectionError("scheduler gone")
    response = await stage(scheduler, metrics)(ctx_for("a"), ok)
    assert response.status_code == 200
    assert len(metrics.admission_errors.calls) == 1


async def test_models_without_admission_pass_straight_through():
    scheduler = RecordingScheduler()
    ctx = ctx_for("a")
    ctx.parsed = ChatCompletionRequest(model="other", messages=[{"role": "user", "content": "x"}])
    await stage(scheduler)(ctx, ok)
    assert scheduler.acquired == []


@pytest.mark.parametrize(
    ("tenant", "header", "tier"),
    [
        ("a", None, "interactive"),
        ("a", "batch", "interactive"),
        ("b", None, "batch"),
        ("b", "interactive", "interactive"),
        ("b", "bogus", "batch"),
    ],
)
async def test_tier_comes_from_the_tenant_or_its_allowed_header(tenant, header, tier):
    scheduler = RecordingScheduler()
    headers = {"x-forge-priority": header} if header else {}
    await stage(scheduler)(ctx_for(tenant, headers), ok)
    assert scheduler.acquired[0][1] == tier


async def test_ops_riding_on_a_failed_acquire_are_not_lost(monkeypatch):
    monkeypatch.setattr(warm_slots, "FLUSH_S", 60)
    scheduler = RecordingScheduler()
    admission = stage(scheduler, keep_warm_s=0)
    await admission(ctx_for("a"), ok)
    scheduler.fail = ConnectionError("blip")
    await admission(ctx_for("a"), ok)  # admitted without a slot (fail open)
    await admission(ctx_for("a"), ok)
    first = scheduler.granted[0]
    ops = [call[2] for call in scheduler.acquired]
    assert ops == [[], [("release", first)], [("release", first)]], "sent again after the blip"
    assert scheduler.slots_used == 1


async def test_a_long_stream_keeps_its_slot_through_many_renewal_periods():
    """The renewals come every third of the TTL of real time (0.1 s here); the lease lives on
    the scheduler's clock, which moves only here, half a TTL at a time, each step waiting for a
    renewal to land: however slow the machine, the lease expires only if renewals stop."""
    clock = Clock(1000.0)
    scheduler = RecordingScheduler()
    scheduler.scheduler = FairScheduler(4, lease_ttl_s=0.3, clock=clock)
    admission = stage(scheduler, keep_warm_s=0)

    async def long_stream(ctx: RequestContext) -> Response:
        for _ in range(8):  # four TTLs
            renewals = len(scheduler.synced)
            clock.advance(0.15)
            await eventually_async(
                lambda renewals=renewals: len(scheduler.synced) > renewals,
                timeout_s=5,
                what="the slot's lease renewed",
            )
            assert scheduler.scheduler.expire_leases() == 0
        assert scheduler.slots_used == 1
        return Response(b"{}")

    await admission(ctx_for("a"), long_stream)
    slots = admission.slots[MODEL]
    assert slots.kept_alive == 0, "its renewals stopped with the request"
    await eventually_async(lambda: scheduler.slots_used == 0, timeout_s=2, what="slot back")
