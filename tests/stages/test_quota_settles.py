"""What a request owes its tenant's budget always lands: refunds and lease releases are retried
until the store confirms them, a retry after a lost reply is applied once, and a reserve cut
short (a timeout the store may have applied, a client that left mid-call) leaves nothing taken
behind. Over the embedded store with failures injected per call."""

from __future__ import annotations

import asyncio

import pytest
from starlette.responses import Response

from serve_app.config.models import TenantConfig
from serve_app.stages.quota import QuotaStage
from serve_app.stages.quota_buckets import TenantQuota
from serve_app.stages.settles import Settles
from serve_app.stages.store_failures import StoreFailures
from serve_app.store import MemoryStore, StoreError
from tests.doubles import RecordingMetrics
from tests.stages.test_quota_stage import answered, ctx_for
from tests.stages.test_quota_stage import tenant as quota_tenant

LIMITS = {"tpm": 10_000, "max_concurrent_streams": 1}


class FlakyStore(MemoryStore):
    """The embedded store, whose next calls of an op fail as planned: ``"before"`` (the store
    never saw it: a refused connection) or ``"after"`` (applied, then the reply was lost: a
    timeout). ``gate`` holds an op's call until set (a call still under way)."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: 1000.0)  # no refill mid-test: the levels are exact
        self.plans: dict[str, list[str]] = {}
        self.gates: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Event] = {}

    async def _run(self, op: str, call):
        if op in self.gates:
            self.entered.setdefault(op, asyncio.Event()).set()
            await self.gates[op].wait()
        plan = self.plans.get(op) or []
        how = plan.pop(0) if plan else None
        if how == "before":
            raise StoreError(f"{op}: connection refused (injected)")
        result = await call()
        if how == "after":
            raise StoreError(f"{op}: timed out (injected; it was applied)")
        return result

    async def adjust(self, bucket, delta, *, once=None):
        return await self._run(
            "adjust", lambda: super(FlakyStore, self).adjust(bucket, delta, once=once)
        )

    async def acquire_lease(self, key, lease_id, limit, ttl_s):
        return await self._run(
            "acquire_lease",
            lambda: super(FlakyStore, self).acquire_lease(key, lease_id, limit, ttl_s),
        )

    async def reserve(self, buckets, amounts, lease_key, lease_id, limit, ttl_s):
        return await self._run(
            "reserve",
            lambda: super(FlakyStore, self).reserve(
                buckets, amounts, lease_key, lease_id, limit, ttl_s
            ),
        )

    async def unreserve(self, buckets, amounts, lease_key, lease_id):
        return await self._run(
            "unreserve",
            lambda: super(FlakyStore, self).unreserve(buckets, amounts, lease_key, lease_id),
        )

    async def release_lease(self, key, lease_id):
        return await self._run(
            "release_lease", lambda: super(FlakyStore, self).release_lease(key, lease_id)
        )


def tenant() -> TenantConfig:
    return quota_tenant(**LIMITS)


def stage_over(store: FlakyStore, metrics: RecordingMetrics | None = None) -> QuotaStage:
    metrics = metrics or RecordingMetrics()
    settles = Settles(StoreFailures(metrics, "retried"), first_backoff_s=0.001, max_backoff_s=0.01)
    return QuotaStage(store, metrics, [tenant()], {}, settles)


async def levels(store: MemoryStore, t: TenantConfig) -> tuple[float, int]:
    quota = TenantQuota.of(t)
    (tokens,) = await store.peek([quota.tokens])
    holders = store._holders(quota.stream_key, store._clock())
    return tokens, len(holders)


async def served_one(stage: QuotaStage, t: TenantConfig) -> None:
    response = await stage(ctx_for(t), answered({"prompt_tokens": 20, "completion_tokens": 30}))
    assert response.status_code == 200
    await response({"type": "http"}, _receive, _send)  # the response ends: settle
    await stage.settles.drain()


async def _receive():
    return {"type": "http.disconnect"}


async def _send(message):
    return None


@pytest.mark.parametrize("how", ["before", "after"])
async def test_a_refund_meeting_a_store_failure_is_retried_and_applied_once(how):
    store, t = FlakyStore(), tenant()
    store.plans["adjust"] = [how, how]  # fails twice, then the store answers
    stage = stage_over(store)
    await served_one(stage, t)
    tokens, streams = await levels(store, t)
    # The 50 used, once; the bucket refills ~1 token per 6 ms on the real clock meanwhile.
    assert 10_000 - 50 - 1 <= tokens <= 10_000 - 50 + 25, "charged the 50 used, once"
    assert streams == 0


async def test_a_lease_release_meeting_a_store_failure_is_retried_until_the_stream_is_free():
    store, t = FlakyStore(), tenant()
    store.plans["release_lease"] = ["before", "after", "before"]
    stage = stage_over(store)
    await served_one(stage, t)
    assert (await levels(store, t))[1] == 0
    await served_one(stage, t)  # the tenant's one stream is free again: not a 429


@pytest.mark.parametrize("how", ["before", "after"])
async def test_a_reserve_unanswered_is_undone_and_the_request_charged_once_locally(how):
    """The take and the lease are asked in one call (``Store.reserve``) and its reply is lost:
    applied ("after") or not ("before"), nobody can tell. It is undone exactly (its lease is
    held if and only if it took the tokens: ``unreserve``, retried until it lands), and the
    request is served on this replica's local share instead: charged once, there."""
    store, t = FlakyStore(), tenant()
    store.plans["reserve"] = [how]
    store.plans["unreserve"] = ["before"]  # the undo meets the outage too, and is retried
    metrics = RecordingMetrics()
    stage = stage_over(store, metrics)
    await served_one(stage, t)
    assert {"op": "reserve"} in metrics.store_errors.calls
    assert await levels(store, t) == (pytest.approx(10_000, abs=1), 0)
    (local_tokens,) = await stage.local_store.peek([stage.local_quotas[t.name].tokens])
    # Charged once (50): not twice (9,900), not never (10,000). The share refills at ~167
    # tokens/s on the real clock meanwhile, one token per 6 ms a loaded machine may take here.
    assert 10_000 - 50 - 1 <= local_tokens <= 10_000 - 50 + 25


async def test_a_client_leaving_during_the_lease_call_leaves_nothing_taken():
    store, t = FlakyStore(), tenant()
    store.gates["reserve"] = asyncio.Event()
    stage = stage_over(store)
    request = asyncio.create_task(stage(ctx_for(t), answered({})))
    await asyncio.wait_for(store.entered.setdefault("reserve", asyncio.Event()).wait(), 5)
    request.cancel()  # the client left while the lease was being asked for
    with pytest.raises(asyncio.CancelledError):
        await request
    store.gates["reserve"].set()  # the call lands after all: what it took is undone
    await stage.settles.drain()
    tokens, streams = await levels(store, t)
    assert tokens == pytest.approx(10_000, abs=1), "nothing taken is left behind"
    assert streams == 0


async def test_a_refused_lease_takes_no_reservation():
    store, t = FlakyStore(), tenant()
    stage = stage_over(store)
    held, serving = asyncio.Event(), asyncio.Event()

    async def holds(ctx):
        serving.set()
        await held.wait()
        return Response(b"{}")

    first = asyncio.create_task(stage(ctx_for(t), holds))
    await asyncio.wait_for(serving.wait(), 5)
    with pytest.raises(Exception) as info:
        await stage(ctx_for(t), answered({}))
    assert getattr(info.value, "status", None) == 429
    await stage.settles.drain()
    tokens, _ = await levels(store, t)
    # One reservation (prompt + 100) is out, the held request's: the refused one took none.
    assert 100 < 10_000 - tokens < 200
    held.set()
    await first


async def test_a_settle_that_never_lands_gives_up_at_its_deadline_and_says_so():
    store, t = FlakyStore(), tenant()
    store.plans["adjust"] = ["before"] * 1000
    metrics = RecordingMetrics()
    settles = Settles(StoreFailures(metrics, "retried"), deadline_s=0.05, first_backoff_s=0.001)
    stage = QuotaStage(store, metrics, [t], {}, settles)
    await served_one(stage, t)
    assert settles.given_up == 1
    assert {"op": "settle_given_up"} in metrics.store_errors.calls
