"""The quota stage over the embedded store: reserve, settle exactly once, leases, fail open."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from serve_app.config.models import TenantConfig
from serve_app.errors import ForgeError
from serve_app.pipeline import RequestContext
from serve_app.protocol import ChatCompletionRequest
from serve_app.stages import quota as quota_module
from serve_app.stages.quota import QuotaStage
from serve_app.stages.quota_buckets import TenantQuota
from serve_app.stages.settles import Settles
from serve_app.stages.store_failures import StoreFailures
from serve_app.store import MemoryStore, StoreError
from tests.doubles import Clock, DownStore, RecordingMetrics
from tests.polling import eventually_async

MESSAGES = [{"role": "user", "content": "hello there"}]


def tenant(**limits) -> TenantConfig:
    return TenantConfig(name="acme", key_hashes=["a" * 64], limits=limits)


def ctx_for(t: TenantConfig, max_tokens: int = 100) -> RequestContext:
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []})
    ctx = RequestContext(request, "chat")
    ctx.request_id = "req-1"
    ctx.tenant = t
    ctx.body = {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens}
    ctx.parsed = ChatCompletionRequest.model_validate(ctx.body)
    return ctx


def answered(usage: dict):
    async def call_next(ctx: RequestContext) -> Response:
        ctx.usage = usage
        ctx.first_byte_at = 1.0
        return Response(b"{}")

    return call_next


async def settled() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_reserves_up_front_and_settles_to_real_usage():
    store, t = MemoryStore(), tenant(tpm=10_000)
    stage = QuotaStage(store, RecordingMetrics(), [t], {})
    bucket = TenantQuota.of(t).tokens
    response = await stage(ctx_for(t), answered({"prompt_tokens": 20, "completion_tokens": 30}))
    assert response.headers["x-ratelimit-limit-tokens"] == "10000"
    await settled()
    (level,) = await store.peek([bucket])
    assert 10_000 - 50 - 1 <= level <= 10_000 - 50 + 1, "charged exactly the 50 used"


async def test_a_failure_before_any_byte_refunds_every_token():
    store, t = MemoryStore(), tenant(tpm=10_000)
    stage = QuotaStage(store, RecordingMetrics(), [t], {})

    async def boom(ctx):
        raise ForgeError(502, "down", type="api_error")

    with pytest.raises(ForgeError):
        await stage(ctx_for(t), boom)
    await settled()
    (level,) = await store.peek([TenantQuota.of(t).tokens])
    assert level >= 10_000 - 1


class CountsRenewals(MemoryStore):
    """The embedded store, recording each batch of lease renewals (one round trip each)."""

    def __init__(self, clock: Clock | None = None) -> None:
        super().__init__(clock=clock or Clock(1000.0))
        self.batches: list[list[tuple[str, str]]] = []

        self.down = False  # renewals fail as an unreachable store's do

    @property
    def renewals(self) -> int:
        return len(self.batches)

    async def renew_leases(self, leases, ttl_s):
        self.batches.append(list(leases))
        if self.down:
            raise StoreError("store down (test double)")
        return await super().renew_leases(leases, ttl_s)

    def flush(self) -> None:
        """Every key gone at once, as Redis after ``FLUSHALL`` or a failover to an empty one."""
        self._data.clear()


async def test_a_long_stream_keeps_its_lease_and_gives_it_back_at_the_end(monkeypatch):
    # The stage renews every TTL/3 of real time (2 ms here); the lease lives on the store's
    # clock, which moves only here: half a TTL at a time, each step waiting for a renewal to
    # land. However slow the machine, the lease expires only if the stage stops renewing it.
    ttl_s = 0.006
    monkeypatch.setattr(quota_module, "LEASE_TTL_S", ttl_s)
    clock = Clock(1000.0)
    store, t = CountsRenewals(clock), tenant(max_concurrent_streams=1)
    stage = QuotaStage(store, RecordingMetrics(), [t], {})

    async def slow_body():
        for _ in range(4):
            for _ in range(4):  # two TTLs per chunk
                renewals = store.renewals
                clock.advance(ttl_s / 2)
                await eventually_async(
                    lambda renewals=renewals: store.renewals > renewals,
                    timeout_s=5,
                    what="the stage to renew the stream's lease",
                )
            yield b"data: {}\n\n"

    async def stream(ctx):
        return StreamingResponse(slow_body())

    response = await stage(ctx_for(t), stream)
    body = response.body_iterator
    chunks = [await anext(body) for _ in range(3)]  # six TTLs in on the store's clock
    # While it streams, a second request is refused: the lease was renewed, not expired.
    with pytest.raises(ForgeError) as info:
        await stage(ctx_for(t), answered({}))
    assert info.value.status == 429
    chunks += [c async for c in body]
    assert len(chunks) == 4
    await settled()
    assert (await stage(ctx_for(t), answered({}))).status_code == 200


class Streams:
    """Requests of one tenant that hold their stream (and its lease) until ``end``."""

    def __init__(self, stage: QuotaStage, t: TenantConfig) -> None:
        self.stage, self.tenant = stage, t
        self.running: list[tuple[asyncio.Task, asyncio.Event]] = []

    async def start(self) -> None:
        serving, done = asyncio.Event(), asyncio.Event()

        async def holds_its_stream(ctx: RequestContext) -> Response:
            serving.set()  # past quota: its lease is held
            await done.wait()
            return Response(b"{}")

        task = asyncio.create_task(self.stage(ctx_for(self.tenant), holds_its_stream))
        await asyncio.wait_for(serving.wait(), 5)
        self.running.append((task, done))

    async def end(self, i: int) -> None:
        task, done = self.running[i]
        done.set()
        await task
        await self.stage.settles.drain()

    async def refused(self) -> bool:
        try:
            await self.stage(ctx_for(self.tenant), answered({}))
        except ForgeError as err:
            return err.status == 429
        await self.stage.settles.drain()
        return False


async def test_every_live_streams_lease_is_renewed_in_one_store_round_trip():
    store, t = CountsRenewals(), tenant(max_concurrent_streams=5)
    stage = QuotaStage(store, RecordingMetrics(), [t], {})
    streams = Streams(stage, t)
    for _ in range(3):
        await streams.start()
    await stage.leases.renew_now()
    (batch,) = store.batches
    assert len(batch) == 3 and {key for key, _ in batch} == {"streams:{acme}"}
    for i in range(3):
        await streams.end(i)
    assert stage.leases.kept == 0, "ended streams are renewed no more"


async def test_a_renewal_takes_back_a_lease_the_store_lost_but_not_one_released():
    """The store was flushed under two live streams (cap 2): the next renewal holds both leases
    again, so a third request is refused; a stream that ended is not brought back."""
    store, t = CountsRenewals(), tenant(max_concurrent_streams=2)
    stage = QuotaStage(store, RecordingMetrics(), [t], {})
    streams = Streams(stage, t)
    await streams.start()
    await streams.start()
    assert await streams.refused()
    store.flush()
    assert not await streams.refused(), "flushed: the store counts no stream"
    await stage.leases.renew_now()
    assert await streams.refused(), "both live streams hold their leases again"
    await streams.end(0)
    await stage.leases.renew_now()
    assert not await streams.refused(), "the ended stream's lease stayed released"
    await streams.end(1)


async def test_a_failed_renewal_is_counted_and_the_next_period_renews():
    store, t, metrics = CountsRenewals(), tenant(max_concurrent_streams=1), RecordingMetrics()
    stage = QuotaStage(store, metrics, [t], {})
    streams = Streams(stage, t)
    await streams.start()
    store.down = True
    await stage.leases.renew_now()
    assert metrics.store_errors.calls == [{"op": "renew"}]
    store.down = False
    await stage.leases.renew_now()
    assert len(store.batches) == 2 and await streams.refused()
    await streams.end(0)


async def test_the_concurrent_request_cap_and_its_remainder_are_in_the_headers():
    """What lets a client (and the eval gate) see a leaked lease: a low remainder when idle."""
    store, t = MemoryStore(), tenant(max_concurrent_streams=3)
    stage = QuotaStage(store, RecordingMetrics(), [t], {})
    first = await stage(ctx_for(t), answered({}))
    assert first.headers["x-ratelimit-limit-concurrent-requests"] == "3"
    assert first.headers["x-ratelimit-remaining-concurrent-requests"] == "2"  # itself held one
    await settled()

    seen = []

    async def inner(ctx):  # a request while another holds its lease
        seen.append(await stage(ctx_for(t), answered({})))
        return Response(b"{}")

    await stage(ctx_for(t), inner)
    assert seen[0].headers["x-ratelimit-remaining-concurrent-requests"] == "1"


async def test_a_failing_store_serves_an_open_tenant_unmetered_and_counts():
    metrics = RecordingMetrics()
    t = tenant(rpm=1).model_copy(update={"on_store_failure": "open"})
    stage = QuotaStage(DownStore(), metrics, [t], {})
    for _ in range(3):
        assert (await stage(ctx_for(t), answered({}))).status_code == 200
    assert metrics.store_errors.calls == [{"op": "reserve"}] * 3
    assert metrics.unmetered.calls == [{"tenant": "acme"}] * 3


async def test_a_failing_store_holds_a_tenant_to_this_replicas_share_of_its_budget():
    """Two gateway replicas: each holds the tenant to half its 10 requests' burst (and half its
    stream cap) while the store is unreachable, so together they never give it more than its
    limit; the 429 says so as any other."""
    metrics, t = RecordingMetrics(), tenant(rpm=10, max_concurrent_streams=4)
    # What each request may have left in the unreachable store (its reserve, unanswered) is
    # undone by a settle retried until its deadline: short here, so each drain is quick.
    settles = Settles(StoreFailures(metrics, "retried"), deadline_s=0.05, first_backoff_s=0.001)
    stage = QuotaStage(DownStore(), metrics, [t], {}, settles, local_share=0.5)
    statuses = []
    for _ in range(7):
        try:
            statuses.append((await stage(ctx_for(t), answered({}))).status_code)
        except ForgeError as err:
            statuses.append(err.status)
        await stage.settles.drain()  # its stream lease is back before the next one
    assert statuses == [200] * 5 + [429] * 2
    assert metrics.unmetered.calls == []
    assert TenantQuota.of(t, share=0.5).max_streams == 2


async def test_a_failing_store_refuses_a_closed_tenant_with_a_503():
    metrics = RecordingMetrics()
    t = tenant(rpm=10).model_copy(update={"on_store_failure": "closed"})
    stage = QuotaStage(DownStore(), metrics, [t], {})
    with pytest.raises(ForgeError) as info:
        await stage(ctx_for(t), answered({}))
    assert info.value.status == 503 and info.value.code == "budget_store_unavailable"
    assert info.value.headers["retry-after"]


async def test_a_refused_lease_is_a_429_even_when_its_refund_fails():
    """Bug: a refused lease whose refund raised StoreError fell into the fail-open path and
    was served over the tenant's stream cap. The take and the lease are now asked together
    (``Store.reserve``): a refused lease takes nothing, so there is no refund left to fail."""

    class RefundFails(MemoryStore):
        async def adjust(self, bucket, delta, *, once=None):
            raise StoreError("redis went away mid-request")

    metrics, t = RecordingMetrics(), tenant(tpm=10_000, max_concurrent_streams=1)
    store = RefundFails()
    stage = QuotaStage(store, metrics, [t], {})
    serving, held = asyncio.Event(), asyncio.Event()

    async def holds_its_stream(ctx: RequestContext) -> Response:
        serving.set()  # past quota: its lease is held
        await held.wait()
        return Response(b"{}")

    first = asyncio.create_task(stage(ctx_for(t), holds_its_stream))
    await asyncio.wait_for(serving.wait(), 2)
    with pytest.raises(ForgeError) as info:
        await stage(ctx_for(t), answered({}))
    assert info.value.status == 429
    assert metrics.shed.calls[-1] == {"tenant": "acme", "reason": "concurrency"}
    await settled()
    assert metrics.store_errors.calls == []  # nothing to give back: no refund was needed
    held.set()
    assert (await first).status_code == 200
    await stage.settles.aclose(0)  # this store never recovers: stop retrying
