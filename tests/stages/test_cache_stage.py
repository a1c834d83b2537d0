"""The response cache through the whole gateway, as a client sees it: the official ``openai``
client over httpx's ``ASGITransport`` into a gateway wired in process (real replicas and
engines, a real scheduler, the embedded store, the mock fallback as an ASGI app).

The cache keeps a miss's answer in a background task once the response has ended, so a test
that needs the entry waits for it (``stored``) instead of sleeping; a test that needs an answer
*not* to have been kept first lets a later answer be kept (``barrier``): the store's tasks run
in the order they were made, so by then the earlier one would have been too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import openai
import orjson
import pytest
from openai.types import CompletionUsage

from serve_app.auth.keys import hash_key
from serve_app.config.models import load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.mock_openai import create_mock_app
from serve_app.stages.quota_buckets import TenantQuota
from serve_app.store import GuardedStore, MemoryStore, Store
from tests.doubles import Clock, DownStore, RecordingMetrics
from tests.polling import eventually_async

MODEL = "forge-sim"
UPSTREAM_KEY = "sk-test-cache-upstream"
KEY_ENV = "FORGE_TEST_CACHE_UPSTREAM_KEY"
FAST = {"prefill_base_s": 0.0, "decode_base_s": 0.0, "output_tokens_min": 4, "output_tokens_max": 8}
KEYS = {
    "alpha": "sk-cache-alpha",
    "beta": "sk-cache-beta",
    "pooled-1": "sk-cache-pooled-1",
    "pooled-2": "sk-cache-pooled-2",
    "metered": "sk-cache-metered",
    "capped": "sk-cache-capped",
}
TPM = 100_000


def forge_args(**overrides) -> dict:
    limits = {"metered": {"tpm": TPM}, "capped": {"rpm": 1, "burst_requests": 2}}
    shared = {"pooled-1", "pooled-2"}
    tenants = [
        {
            "name": name,
            "key_hashes": [hash_key(key)],
            "limits": limits.get(name, {}),
            "cache_scope": "shared" if name in shared else "tenant",
        }
        for name, key in KEYS.items()
    ]
    pool = {
        "name": "primary",
        "model": MODEL,
        "engine": FAST,
        "admission": {"max_inflight": 4},
        "deployment": {"num_replicas": 2},
        **overrides.pop("pool", {}),
    }
    return {
        "tenants": tenants,
        "pools": [pool],
        "fallback": {
            "base_url": "http://upstream.test/v1",
            "model": "mock-gemini",
            "api_key_env": KEY_ENV,
            "first_token_timeout_s": 5,
        },
        "resilience": {"fallback_probe_interval_s": 0.05},
        **overrides,
    }


@dataclass
class Rig:
    gateway: Gateway
    metrics: RecordingMetrics
    clients: dict[str, openai.AsyncOpenAI]

    def __getitem__(self, tenant: str) -> openai.AsyncOpenAI:
        return self.clients[tenant]

    @property
    def store(self) -> Store:
        return self.gateway.store

    def replicas(self) -> list:
        return list(self.gateway.backends["primary"].replicas.values())

    def generated_tokens(self) -> int:
        return sum(r.stats()["generation_tokens"] for r in self.replicas())

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(self.gateway.asgi_app()), base_url="http://forge.test"
        )


@contextlib.asynccontextmanager
async def running(args: dict, store: Store | None = None) -> AsyncIterator[Rig]:
    metrics = RecordingMetrics()
    upstream = httpx.ASGITransport(create_mock_app("mock-gemini", FAST, api_key=UPSTREAM_KEY))
    gateway = build_local_gateway(
        load_config(args), store=store, metrics=metrics, fallback_transport=upstream
    )
    async with gateway.lifespan(), contextlib.AsyncExitStack() as stack:
        clients = {}
        for tenant, key in KEYS.items():
            http = httpx.AsyncClient(
                transport=httpx.ASGITransport(gateway.asgi_app()), base_url="http://forge.test"
            )
            clients[tenant] = await stack.enter_async_context(
                openai.AsyncOpenAI(
                    base_url="http://forge.test/v1", api_key=key, http_client=http, max_retries=0
                )
            )
        yield Rig(gateway, metrics, clients)


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch) -> None:
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with running(forge_args()) as rig:
        yield rig


def ask(content: str = "Hello, Forge", **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 6,
        **extra,
    }


STREAM = {"stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Answer:
    """One chat answer as the client saw it, streamed or not."""

    cache: str
    backend: str
    text: str
    finish_reason: str | None
    usage: CompletionUsage | None
    headers: httpx.Headers


async def chat(client: openai.AsyncOpenAI, stream: bool = False, **body) -> Answer:
    body = ask(**body)
    if not stream:
        raw = await client.chat.completions.with_raw_response.create(**body)
        completion = raw.parse()
        (choice,) = completion.choices
        return Answer(
            raw.headers.get("x-forge-cache", ""),
            raw.headers.get("x-forge-backend", ""),
            choice.message.content,
            choice.finish_reason,
            completion.usage,
            raw.headers,
        )
    raw = await client.chat.completions.with_raw_response.create(**body, **STREAM)
    chunks = [chunk async for chunk in raw.parse()]
    choices = [c.choices[0] for c in chunks if c.choices]
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1 and chunks[-1].usage is not None, "one usage chunk, the last"
    return Answer(
        raw.headers.get("x-forge-cache", ""),
        raw.headers.get("x-forge-backend", ""),
        "".join(c.delta.content or "" for c in choices),
        next((c.finish_reason for c in choices if c.finish_reason), None),
        usages[0],
        raw.headers,
    )


def same_answer(hit: Answer, miss: Answer) -> None:
    assert miss.text, "the model said something"
    assert (hit.text, hit.finish_reason) == (miss.text, miss.finish_reason)
    assert hit.usage == miss.usage


async def stored(rig: Rig, more_than: int = 0) -> None:
    """Until the cache holds more than ``more_than`` bytes of answers."""
    await eventually_async(
        lambda: rig.store.cache_bytes > more_than,
        timeout_s=10,
        what="an answer kept in the cache",
        explain=lambda: rig.store.cache_bytes,
    )


async def barrier(rig: Rig, client: openai.AsyncOpenAI) -> None:
    """Let another, cacheable answer be kept: any store the earlier requests made is done."""
    before = rig.store.cache_bytes
    answer = await chat(client, content="a barrier: something else entirely")
    assert (answer.cache, answer.backend) == ("miss", "primary")
    await stored(rig, before)


# -- hits ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("first", "second"), [(False, False), (True, True)])
async def test_a_deterministic_repeat_is_a_hit_with_the_same_answer(rig: Rig, first, second):
    miss = await chat(rig["alpha"], stream=first)
    assert (miss.cache, miss.backend) == ("miss", "primary")
    await stored(rig)
    hit = await chat(rig["alpha"], stream=second)
    assert (hit.cache, hit.backend) == ("hit", "cache")
    assert "x-forge-replica" not in hit.headers
    same_answer(hit, miss)
    results = [c["result"] for c in rig.metrics.cache.calls]
    assert results == ["miss", "hit"]
    assert rig.metrics.cache_hits.calls == [{"tenant": "alpha"}]


@pytest.mark.parametrize(("first", "second"), [(True, False), (False, True)])
async def test_one_entry_answers_both_a_streamed_and_a_non_streamed_repeat(rig: Rig, first, second):
    miss = await chat(rig["alpha"], stream=first)
    assert miss.cache == "miss"
    await stored(rig)
    hit = await chat(rig["alpha"], stream=second)
    assert (hit.cache, hit.backend) == ("hit", "cache")
    same_answer(hit, miss)


async def test_a_streamed_hit_without_include_usage_has_no_usage_chunk(rig: Rig):
    miss = await chat(rig["alpha"])
    await stored(rig)
    stream = await rig["alpha"].chat.completions.create(**ask(), stream=True)
    chunks = [chunk async for chunk in stream]
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == miss.text


async def test_a_text_completion_repeat_is_a_hit_too(rig: Rig):
    body = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 6}
    client = rig["alpha"]
    raw = await client.completions.with_raw_response.create(**body)
    assert raw.headers["x-forge-cache"] == "miss"
    miss = raw.parse()
    await stored(rig)
    raw = await client.completions.with_raw_response.create(**body)
    hit = raw.parse()
    assert (raw.headers["x-forge-cache"], raw.headers["x-forge-backend"]) == ("hit", "cache")
    assert hit.choices[0].text == miss.choices[0].text and hit.usage == miss.usage
    stream = await client.completions.create(**body, **STREAM)
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == miss.choices[0].text
    assert chunks[-1].usage == miss.usage


async def test_a_hit_reaches_no_engine_and_takes_no_admission_slot(rig: Rig):
    miss = await chat(rig["alpha"])
    await stored(rig)
    generated, admitted = rig.generated_tokens(), len(rig.metrics.admitted.calls)
    assert generated >= miss.usage.completion_tokens and admitted == 1
    for stream in (False, True):
        assert (await chat(rig["alpha"], stream=stream)).cache == "hit"
    assert rig.generated_tokens() == generated
    assert len(rig.metrics.admitted.calls) == admitted


async def test_a_hit_answers_while_a_long_generation_holds_the_pools_only_slot():
    """Admission has one slot and no queue: a request that needs the pool is refused at once
    while a hung generation holds it, and a cached answer is served all the same."""
    args = forge_args(pool={"admission": {"max_inflight": 1, "queue_cap": 0, "keep_warm_s": 0}})
    async with running(args) as rig:
        await chat(rig["alpha"])
        await stored(rig)
        for replica in rig.replicas():
            replica.set_fault({"mode": "hang"})
        async with rig.http() as h:
            hung = asyncio.create_task(
                h.post(
                    "/v1/chat/completions",
                    json=ask("a long one", temperature=0.7, stream=True),
                    headers={"authorization": f"Bearer {KEYS['beta']}"},
                )
            )
            try:
                await eventually_async(
                    lambda: sum(r.open_streams for r in rig.replicas()) == 1,
                    timeout_s=10,
                    what="a generation holding the slot",
                )
                with pytest.raises(openai.RateLimitError):
                    await chat(rig["alpha"], temperature=0.7)  # needs the slot: refused
                hit = await chat(rig["alpha"])
                assert (hit.cache, hit.backend) == ("hit", "cache")
                assert not hung.done()
            finally:
                hung.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await hung


# -- never a hit -----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.7, None])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_sampled_request_is_never_cached(rig: Rig, temperature, stream):
    extra = {"temperature": temperature} if temperature is not None else {}
    body = ask(**extra)
    if temperature is None:
        del body["temperature"]
    answers = []
    for _ in range(2):
        if stream:
            raw = await rig["alpha"].chat.completions.with_raw_response.create(**body, **STREAM)
            assert [c async for c in raw.parse()]
        else:
            raw = await rig["alpha"].chat.completions.with_raw_response.create(**body)
            assert raw.parse().choices[0].message.content
        answers.append((raw.headers["x-forge-cache"], raw.headers["x-forge-backend"]))
    assert answers == [("bypass", "primary")] * 2
    assert rig.store.cache_bytes == 0
    assert [c["result"] for c in rig.metrics.cache.calls] == ["bypass", "bypass"]


@pytest.mark.parametrize("stream", [False, True])
async def test_one_tenants_answer_is_never_served_to_another(rig: Rig, stream: bool):
    alpha = await chat(rig["alpha"])
    await stored(rig)
    # Beta asks the same, JSON or streamed: served by the pool, not from alpha's entry. (Its
    # own answer is stored once it ends, so one request per case: a second would hit it.)
    beta = await chat(rig["beta"], stream=stream)
    assert (beta.cache, beta.backend) == ("miss", "primary")
    assert (await chat(rig["alpha"])).cache == "hit"
    assert (await chat(rig["pooled-1"])).cache == "miss", "shared is not alpha's own scope"
    assert alpha.text


async def test_tenants_that_both_chose_the_shared_scope_share_answers(rig: Rig):
    """Shared, but never told: the other tenant's hit says miss (``stages/cache.py``), and is a
    hit all the same: no engine works for it, and the books count it."""
    first = await chat(rig["pooled-1"])
    assert first.cache == "miss"
    await stored(rig)
    generated = rig.generated_tokens()
    second = await chat(rig["pooled-2"], stream=True)
    assert (second.cache, second.backend) == ("miss", "primary")
    assert second.headers["x-forge-replica"] == first.headers["x-forge-replica"]
    same_answer(second, first)
    assert rig.generated_tokens() == generated, "served from the cache"
    assert rig.metrics.cache_hits.calls == [{"tenant": "pooled-2"}]
    mine = await chat(rig["pooled-1"], stream=True)
    assert (mine.cache, mine.backend) == ("hit", "cache"), "the tenant that wrote it is told"
    same_answer(mine, first)
    assert (await chat(rig["alpha"])).cache == "miss", "a tenant-scoped tenant is not served it"


async def raw_answer(rig: Rig, tenant: str, stream: bool) -> tuple[httpx.Headers, list[dict]]:
    """The response as it came: its headers, and its JSON body or each SSE chunk's JSON."""
    body = ask("the same question, from two tenants", **(STREAM if stream else {}))
    async with rig.http() as h:
        response = await h.post(
            "/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {KEYS[tenant]}"},
        )
    assert response.status_code == 200
    if not stream:
        return response.headers, [response.json()]
    events = [e for e in response.content.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]"
    return response.headers, [orjson.loads(e[6:]) for e in events[:-1]]


def without_ids(parts: list[dict]) -> list[dict]:
    """What a client could compare between two answers: all but their id and timestamp."""
    return [{k: v for k, v in part.items() if k not in ("id", "created")} for part in parts]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_shared_hit_for_another_tenant_reads_exactly_as_the_miss_that_wrote_it(
    rig: Rig, stream: bool
):
    miss_headers, miss = await raw_answer(rig, "pooled-1", stream)
    await stored(rig)
    hit_headers, hit = await raw_answer(rig, "pooled-2", stream)
    assert rig.metrics.cache_hits.calls == [{"tenant": "pooled-2"}], "a hit, for the books"
    told = ("x-forge-cache", "x-forge-backend", "x-forge-replica", "content-type", "cache-control")
    assert [hit_headers.get(h) for h in told] == [miss_headers.get(h) for h in told]
    assert miss_headers["x-forge-cache"] == "miss"
    assert set(hit_headers) == set(miss_headers), "no header more, none less"
    assert without_ids(hit) == without_ids(miss), "chunk for chunk, a token each"
    # The id is the kind an engine gives, from Forge's key, not the client's x-request-id.
    assert {p["id"].split("-", 1)[1] for p in hit} != {hit_headers["x-request-id"]}


async def test_a_shared_hit_for_another_tenant_takes_as_long_as_the_writers_miss():
    """Told as a miss, it is paced like one: never sooner than the writer's miss took (a lower
    bound only: sleeps never end early, so no machine makes this flaky)."""
    slow = {**FAST, "decode_base_s": 0.03}
    async with running(forge_args(pool={"engine": slow})) as rig:
        await chat(rig["pooled-1"], stream=True)  # at least 4 tokens: 4 decode steps
        await stored(rig)
        for stream in (True, False):
            started = time.perf_counter()
            other = await chat(rig["pooled-2"], stream=stream)
            took = time.perf_counter() - started
            assert other.cache == "miss"
            assert took >= 4 * 0.03, f"answered in {took:.3f} s, sooner than any miss could be"
        assert (await chat(rig["pooled-1"], stream=True)).cache == "hit"
        hits = [c["tenant"] for c in rig.metrics.cache_hits.calls]
        assert hits == ["pooled-2", "pooled-2", "pooled-1"], "hits, all three, for the books"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_the_fallback_served_is_never_kept(rig: Rig, stream):
    for replica in rig.replicas():
        replica.set_fault({"mode": "error"})
    served = await chat(rig["alpha"], stream=stream)
    assert (served.cache, served.backend) == ("miss", "fallback")
    assert served.text
    for replica in rig.replicas():
        replica.set_fault(None)
    await barrier(rig, rig["alpha"])
    before = rig.store.cache_bytes
    again = await chat(rig["alpha"], stream=stream)
    assert (again.cache, again.backend) == ("miss", "primary"), "not the fallback's answer"
    await stored(rig, before)
    assert (await chat(rig["alpha"], stream=stream)).cache == "hit", "the pool's answer is kept"


@pytest.mark.parametrize("directive", ["no-cache", "no-store", "No-Cache, max-age=0"])
async def test_the_clients_no_cache_bypasses_the_cache_both_ways(rig: Rig, directive):
    headers = {"Cache-Control": directive}
    first = await chat(rig["alpha"], extra_headers=headers)
    assert (first.cache, first.backend) == ("bypass", "primary")
    await barrier(rig, rig["alpha"])
    before = rig.store.cache_bytes
    assert (await chat(rig["alpha"])).cache == "miss", "the bypassed answer was not kept"
    await stored(rig, before)
    assert (await chat(rig["alpha"])).cache == "hit"
    again = await chat(rig["alpha"], stream=True, extra_headers=headers)
    assert (again.cache, again.backend) == ("bypass", "primary"), "nor is a kept one served"


@pytest.mark.parametrize("stream", [False, True])
async def test_an_answer_larger_than_max_entry_bytes_is_served_but_not_kept(stream):
    async with running(forge_args(cache={"max_entry_bytes": 32})) as rig:
        answers = [await chat(rig["alpha"], stream=stream) for _ in range(2)]
        await eventually_async(
            lambda: rig.metrics.cache_stores.calls == [{"result": "too_large"}] * 2,
            timeout_s=10,
            what="both answers refused as too large",
            explain=lambda: rig.metrics.cache_stores.calls,
        )
        assert [(a.cache, a.backend) for a in answers] == [("miss", "primary")] * 2
        assert all(a.text for a in answers)
        assert rig.store.cache_bytes == 0


# -- the store and the quota -----------------------------------------------------------------


@pytest.mark.parametrize("wrap", [False, True], ids=["down", "guarded-down"])
@pytest.mark.parametrize("stream", [False, True])
async def test_with_the_store_down_a_cacheable_request_is_served_uncached(wrap, stream):
    down = DownStore()
    async with running(forge_args(), store=GuardedStore(down) if wrap else down) as rig:
        answers = [await chat(rig["alpha"], stream=stream) for _ in range(2)]
    assert [(a.cache, a.backend) for a in answers] == [("bypass", "primary")] * 2
    assert all(a.text for a in answers)
    assert rig.metrics.store_errors.calls.count({"op": "cache_get"}) == 2
    errors = [c for c in rig.metrics.cache.calls if c["result"] == "error"]
    assert errors == [{"model": MODEL, "result": "error"}] * 2


async def test_a_hit_is_charged_the_cached_usage_against_the_token_budget():
    store = MemoryStore(clock=Clock(1000.0))  # no refill: every token is accounted for
    async with running(forge_args(), store=store) as rig:
        (metered,) = [t for t in rig.gateway.config.tenants if t.name == "metered"]
        bucket = TenantQuota.of(metered).tokens

        async def charged(expected: int) -> None:
            level = None
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                (level,) = await store.peek([bucket])
                if level == TPM - expected:
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"tokens charged: {TPM - level}, expected {expected}")

        miss = await chat(rig["metered"])
        used = miss.usage.prompt_tokens + miss.usage.completion_tokens
        await stored(rig)
        await charged(used)
        hit = await chat(rig["metered"], stream=True)
        assert hit.cache == "hit" and hit.usage == miss.usage
        await charged(2 * used)
        # What the hit reserved up front was the miss's reservation, minus what the miss used.
        before = int(miss.headers["x-ratelimit-remaining-tokens"])
        after = int(hit.headers["x-ratelimit-remaining-tokens"])
        assert before - after == used


async def test_a_tenant_out_of_requests_is_refused_even_a_cached_answer(rig: Rig):
    miss = await chat(rig["capped"])
    await stored(rig)
    hit = await chat(rig["capped"])  # its burst is two requests
    assert (miss.cache, hit.cache) == ("miss", "hit")
    async with rig.http() as h:
        refused = await h.post(
            "/v1/chat/completions",
            json=ask(),
            headers={"authorization": f"Bearer {KEYS['capped']}"},
        )
    assert refused.status_code == 429
    assert int(refused.headers["retry-after"]) >= 1
    assert "x-forge-cache" not in refused.headers, "quota ran first: the cache never looked"
    assert rig.metrics.cache_hits.calls == [{"tenant": "capped"}]
    with pytest.raises(openai.RateLimitError):
        await chat(rig["capped"], stream=True)


async def test_while_the_pools_engine_is_unknown_or_changing_nothing_is_kept_or_replayed():
    """A pool in its own application reports what it runs; until it has, and while replicas of
    two engines serve (a roll), requests bypass the cache; then it keys by the new engine."""
    from starlette.responses import JSONResponse

    from serve_app.config.models import CacheConfig, TenantConfig
    from serve_app.stages.cache import CachedPool, CacheStage
    from serve_app.store import MemoryStore
    from tests.doubles import MODEL, make_ctx

    identity: list[str | None] = [None]
    metrics = RecordingMetrics()
    stage = CacheStage(
        MemoryStore(),
        metrics,
        CacheConfig(),
        {MODEL: CachedPool("primary", lambda: identity[0])},
    )
    served = misses = 0

    async def engine(ctx) -> JSONResponse:
        nonlocal served
        served += 1
        ctx.backend, ctx.usage = "primary", {"prompt_tokens": 1, "completion_tokens": 1}
        choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}}
        ctx.completion = {
            "id": "x",
            "object": "chat.completion",
            "model": MODEL,
            "choices": [{**choice, "finish_reason": "stop"}],
            "usage": ctx.usage,
        }
        return JSONResponse(ctx.completion)

    async def ask() -> str:
        nonlocal misses
        ctx = make_ctx(stream=False)
        ctx.body["temperature"] = 0
        ctx.parsed = ctx.parsed.model_copy(update={"temperature": 0})
        ctx.tenant = TenantConfig(name="alpha", key_hashes=["a" * 64])
        response = await stage(ctx, engine)
        result = response.headers["x-forge-cache"]
        if result == "miss":  # its entry is written off the request path: wait for it
            misses += 1
            await eventually_async(
                lambda: metrics.cache_stores.calls == [{"result": "stored"}] * misses,
                timeout_s=5,
                what="the miss's answer kept",
                explain=lambda: metrics.cache_stores.calls,
            )
        return result

    assert [await ask(), await ask()] == ["bypass", "bypass"]  # not said yet
    identity[0] = "engine-1"
    assert [await ask(), await ask()] == ["miss", "hit"]
    identity[0] = None  # a roll under way
    assert await ask() == "bypass"
    identity[0] = "engine-2"
    assert [await ask(), await ask()] == ["miss", "hit"]  # the old engine's answer not replayed
    assert served == 5


@pytest.mark.parametrize("max_entry_bytes", [256 * 1024, 4096])
async def test_a_cacheable_stream_costs_the_gateway_its_text_never_its_frames(max_entry_bytes):
    """A frame's envelope is ~30x its text: the cache gathers the text as the frames pass (at
    most ``max_entry_bytes`` of it), and stops at once when it outgrows that, counted. Memory
    by ``tracemalloc``: allocations, not time."""
    import gc
    import tracemalloc

    from starlette.responses import PlainTextResponse

    from serve_app.config.models import CacheConfig, TenantConfig
    from serve_app.stages.cache import CachedPool, CacheStage
    from serve_app.stages.relay import take_frames
    from tests.doubles import MODEL, make_ctx

    frames = 20_000  # 20 000 tokens: ~4 MiB of frames, ~100 KiB of text
    chunk = (
        b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion.chunk",'
        b'"created":1700000000,"model":"forge-sim","choices":[{"index":0,"delta":{"content":'
    )
    end = b'},"logprobs":null,"finish_reason":null}]}\n\n'
    metrics = RecordingMetrics()
    config = CacheConfig(max_entry_bytes=max_entry_bytes)
    stage = CacheStage(MemoryStore(), metrics, config, {MODEL: CachedPool("primary", lambda: "e")})
    held, gathered = 0, None

    async def relayed(ctx) -> PlainTextResponse:
        nonlocal held, gathered
        ctx.backend = "primary"
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(frames):
                # Each frame a new object, as from the network; the write itself is dropped.
                take_frames(ctx, [chunk + orjson.dumps(f" w{i % 1000:03d}") + end])
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        gathered = ctx.gathered
        ctx.usage = {"prompt_tokens": 1, "completion_tokens": frames, "total_tokens": frames + 1}
        return PlainTextResponse("")

    ctx = make_ctx(stream=True)
    ctx.body["temperature"] = 0
    ctx.parsed = ctx.parsed.model_copy(update={"temperature": 0})
    ctx.tenant = TenantConfig(name="alpha", key_hashes=["a" * 64])
    response = await stage(ctx, relayed)
    assert response.headers["x-forge-cache"] == "miss"
    text_bytes = 5 * frames
    if max_entry_bytes > text_bytes:
        assert held < 4 * text_bytes, f"a cacheable stream held {held} bytes"
        assert gathered is not None and gathered.dropped is None
    else:
        assert held < 64 * 1024, f"a stream too long to keep still held {held} bytes"
        assert gathered is not None and gathered.dropped == "too_large"
