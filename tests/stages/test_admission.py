"""The admission stage with a fake scheduler handle: grants, sheds, releases, fails open."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.responses import Response

from serve_app.config import TenantConfig
from serve_app.errors import ForgeError
from serve_app.pipeline import RequestContext
from serve_app.protocol import ChatCompletionRequest
from serve_app.scheduler import Shed
from serve_app.stages import admission as stage_module
from serve_app.stages.admission import AdmissionStage

MODEL = "forge-sim"


class Counter:
    def __init__(self) -> None:
        self.calls: list[dict | None] = []

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.calls.append(tags)


class Metrics:
    def __init__(self) -> None:
        self.shed = Counter()
        self.admitted = Counter()
        self.admission_errors = Counter()


class Method:
    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list[tuple] = []

    def remote(self, *args):
        self.calls.append(args)
        return self.fn(*args)


class FakeScheduler:
    def __init__(self, acquire) -> None:
        self.acquire = Method(acquire)
        self.release = Method(lambda ids: None)
        self.renew = Method(lambda lease_id: None)


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


def stage(scheduler: FakeScheduler, metrics: Metrics | None = None) -> AdmissionStage:
    return AdmissionStage({MODEL: scheduler}, {MODEL: 5.0}, metrics or Metrics())


async def ok(ctx: RequestContext) -> Response:
    return Response(b"{}")


async def granted(tenant, tier, released):
    return "lease-1", 30.0


async def test_granted_request_is_served_and_its_lease_released_on_the_next_acquire(monkeypatch):
    monkeypatch.setattr(stage_module, "RELEASE_FLUSH_S", 60)  # only the piggyback path
    scheduler = FakeScheduler(granted)
    admission = stage(scheduler)
    response = await admission(ctx_for("a"), ok)
    assert response.status_code == 200
    await admission(ctx_for("a"), ok)
    assert scheduler.acquire.calls[1][2] == ["lease-1"], "the first lease rode on the second call"


async def test_a_quiet_gateway_releases_on_its_own(monkeypatch):
    monkeypatch.setattr(stage_module, "RELEASE_FLUSH_S", 0.01)
    scheduler = FakeScheduler(granted)
    await stage(scheduler)(ctx_for("a"), ok)
    await asyncio.sleep(0.05)
    assert scheduler.release.calls == [(["lease-1"],)]


async def test_shed_is_a_429_with_retry_after_and_counted():
    async def shed(tenant, tier, released):
        raise Shed("queue_full", 2.2, tenant)

    metrics = Metrics()
    with pytest.raises(ForgeError) as info:
        await stage(FakeScheduler(shed), metrics)(ctx_for("a"), ok)
    assert info.value.status == 429 and info.value.headers["retry-after"] == "3"
    assert metrics.shed.calls == [{"tenant": "a", "reason": "queue_full"}]


async def test_scheduler_unreachable_admits_and_counts():
    async def broken(tenant, tier, released):
        raise ConnectionError("scheduler gone")

    metrics = Metrics()
    response = await stage(FakeScheduler(broken), metrics)(ctx_for("a"), ok)
    assert response.status_code == 200
    assert len(metrics.admission_errors.calls) == 1


async def test_models_without_admission_pass_straight_through():
    scheduler = FakeScheduler(granted)
    ctx = ctx_for("a")
    ctx.parsed = ChatCompletionRequest(model="other", messages=[{"role": "user", "content": "x"}])
    await stage(scheduler)(ctx, ok)
    assert scheduler.acquire.calls == []


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
    scheduler = FakeScheduler(granted)
    headers = {"x-forge-priority": header} if header else {}
    await stage(scheduler)(ctx_for(tenant, headers), ok)
    assert scheduler.acquire.calls[0][1] == tier


async def test_releases_riding_on_a_failed_acquire_are_not_lost(monkeypatch):
    monkeypatch.setattr(stage_module, "RELEASE_FLUSH_S", 60)
    calls = []

    async def flaky(tenant, tier, released):
        calls.append(list(released))
        if len(calls) == 2:
            raise ConnectionError("blip")
        return f"lease-{len(calls)}", 30.0

    admission = stage(FakeScheduler(flaky), Metrics())
    for _ in range(3):
        await admission(ctx_for("a"), ok)
    assert calls == [[], ["lease-1"], ["lease-1"]], "the blip's releases rode on the next call"
