"""The quota stage over the embedded store: reserve, settle exactly once, leases, fail open."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from serve_app.config import TenantConfig
from serve_app.errors import ForgeError
from serve_app.pipeline import RequestContext
from serve_app.protocol import ChatCompletionRequest
from serve_app.quota import TenantQuota
from serve_app.stages import quota as quota_module
from serve_app.stages.quota import QuotaStage
from serve_app.store import MemoryStore, StoreError
from tests.stages.test_admission import Metrics

MESSAGES = [{"role": "user", "content": "hello there"}]


class StoreMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__()
        from tests.stages.test_admission import Counter

        self.store_errors = Counter()


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
    stage = QuotaStage(store, StoreMetrics(), [t], {})
    bucket = TenantQuota.of(t).tokens
    response = await stage(ctx_for(t), answered({"prompt_tokens": 20, "completion_tokens": 30}))
    assert response.headers["x-ratelimit-limit-tokens"] == "10000"
    await settled()
    (level,) = await store.peek([bucket])
    assert 10_000 - 50 - 1 <= level <= 10_000 - 50 + 1, "charged exactly the 50 used"


async def test_a_failure_before_any_byte_refunds_every_token():
    store, t = MemoryStore(), tenant(tpm=10_000)
    stage = QuotaStage(store, StoreMetrics(), [t], {})

    async def boom(ctx):
        raise ForgeError(502, "down", type="api_error")

    with pytest.raises(ForgeError):
        await stage(ctx_for(t), boom)
    await settled()
    (level,) = await store.peek([TenantQuota.of(t).tokens])
    assert level >= 10_000 - 1


async def test_a_long_stream_keeps_its_lease_and_gives_it_back_at_the_end(monkeypatch):
    monkeypatch.setattr(quota_module, "LEASE_TTL_S", 0.15)
    store, t = MemoryStore(), tenant(max_concurrent_streams=1)
    stage = QuotaStage(store, StoreMetrics(), [t], {})

    async def slow_body():
        for _ in range(4):
            await asyncio.sleep(0.1)  # 0.4 s: well past the 0.15 s TTL
            yield b"data: {}\n\n"

    async def stream(ctx):
        return StreamingResponse(slow_body())

    response = await stage(ctx_for(t), stream)
    body = response.body_iterator
    chunks = [await anext(body) for _ in range(3)]  # 0.3 s in: twice the lease's TTL
    # While it streams, a second request is refused: the lease was renewed, not expired.
    with pytest.raises(ForgeError) as info:
        await stage(ctx_for(t), answered({}))
    assert info.value.status == 429
    chunks += [c async for c in body]
    assert len(chunks) == 4
    await settled()
    assert (await stage(ctx_for(t), answered({}))).status_code == 200


async def test_a_failing_store_serves_unmetered_and_counts():
    class Broken(MemoryStore):
        async def take(self, buckets, amounts):
            raise StoreError("redis down")

    metrics, t = StoreMetrics(), tenant(rpm=1)
    stage = QuotaStage(Broken(), metrics, [t], {})
    for _ in range(3):
        assert (await stage(ctx_for(t), answered({}))).status_code == 200
    assert metrics.store_errors.calls == [{"op": "reserve"}] * 3
