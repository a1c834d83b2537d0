"""Traffic policy through the gateway's HTTP surface, in one process (``serve_app/local.py``):
the official ``openai`` client, real replicas and engines, a real scheduler, breakers and the
mock fallback. What a tenant sees of aliases, canaries, chains and shadows."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import anthropic
import httpx
import openai
import pytest

from serve_app.auth.keys import hash_key
from serve_app.config.models import load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.mock_openai import create_mock_app
from serve_app.resilience.breaker import State
from tests.dialects.conftest import anthropic_client
from tests.doubles import RecordingMetrics
from tests.polling import eventually_async

KEY, LIMITED_KEY, ADMIN_KEY = "sk-test-traffic", "sk-test-limited", "sk-test-traffic-admin"
UPSTREAM_KEY, KEY_ENV = "sk-test-upstream", "FORGE_TEST_TRAFFIC_UPSTREAM_KEY"
FAST = {"prefill_base_s": 0.0, "decode_base_s": 0.0, "output_tokens_min": 4, "output_tokens_max": 8}
SPLIT = {
    "name": "chat",
    "variants": [
        {"name": "stable", "pool": "primary", "weight": 50},
        {"name": "canary", "pool": "canary", "weight": 50},
    ],
    "sticky": "request",
    "chain": [],
}
CHAINED = {
    "name": "chained",
    "variants": [{"name": "main", "pool": "primary"}],
    "chain": [
        {"pool": "small", "when": ["overload", "breaker_open", "context_length"]},
        {"pool": "fallback", "when": ["breaker_open", "error"]},
    ],
}


def forge_args(*models: dict) -> dict:
    return {
        "tenants": [
            {"name": "alpha", "key_hashes": [hash_key(KEY)]},
            {"name": "limited", "key_hashes": [hash_key(LIMITED_KEY)], "models": ["chat"]},
        ],
        "admin": {"key_hashes": [hash_key(ADMIN_KEY)]},
        "pools": [
            {
                "name": "primary",
                "model": "forge-sim",
                "engine": {**FAST, "max_model_len": 256},
                "admission": {"max_inflight": 1, "queue_cap": 4},
            },
            {"name": "canary", "model": "forge-sim-v2", "engine": FAST},
            {"name": "small", "model": "forge-small", "engine": FAST},
        ],
        "fallback": {
            "base_url": "http://upstream.test/v1",
            "model": "mock-gemini",
            "api_key_env": KEY_ENV,
        },
        "cache": {"enabled": False},
        "faults": {"enabled": True},
        "models": list(models) or [SPLIT, CHAINED],
    }


async def started(args: dict, metrics=None) -> Gateway:
    transport = httpx.ASGITransport(create_mock_app("mock-gemini", FAST, api_key=UPSTREAM_KEY))
    return build_local_gateway(load_config(args), fallback_transport=transport, metrics=metrics)


@pytest.fixture
async def gateway(monkeypatch) -> AsyncIterator[Gateway]:
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    gateway = await started(forge_args())
    async with gateway.lifespan():
        yield gateway


def client(gateway: Gateway, key: str = KEY) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(gateway.asgi_app()), base_url="http://forge.test"
    )
    return openai.AsyncOpenAI(
        base_url="http://forge.test/v1", api_key=key, http_client=http, max_retries=0
    )


def ask(model: str, text: str = "Hello, Forge", **extra) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        **extra,
    }


async def test_models_lists_the_aliases_and_a_tenant_sees_only_what_it_may_call(gateway):
    async with client(gateway) as alpha, client(gateway, LIMITED_KEY) as limited:
        assert {"chat", "chained", "forge-sim", "mock-gemini"} <= {
            m.id async for m in alpha.models.list()
        }
        assert [m.id async for m in limited.models.list()] == ["chat"]
        with pytest.raises(openai.NotFoundError) as refused:
            await limited.chat.completions.create(**ask("forge-sim"))
        assert refused.value.body["code"] == "model_not_found"
        raw = await limited.chat.completions.with_raw_response.create(**ask("chat"))
        assert raw.headers["x-forge-variant"] in {"stable", "canary"}


async def test_a_models_card_gives_the_smallest_window_it_may_land_in(gateway):
    """An alias's window is its smallest pool's (``chat``: primary 256 beside canary 8,192):
    what a client may size a request by. The fallback alone has no window Forge knows."""
    async with client(gateway) as alpha, client(gateway, LIMITED_KEY) as limited:
        cards = {m.id: m async for m in alpha.models.list()}
        assert cards["chat"].max_model_len == 256
        assert cards["forge-sim-v2"].max_model_len == 8192
        assert not hasattr(cards["mock-gemini"], "max_model_len")
        retrieved = await alpha.models.retrieve("chat")
        assert (retrieved.id, retrieved.max_model_len) == ("chat", 256)
        with pytest.raises(openai.NotFoundError) as hidden:
            await limited.models.retrieve("forge-sim")  # not this tenant's: as if none
        with pytest.raises(openai.NotFoundError) as missing:
            await alpha.models.retrieve("no-such-model")
    assert hidden.value.body == {**missing.value.body, "message": hidden.value.body["message"]}
    assert hidden.value.body["code"] == "model_not_found"


async def test_anthropics_client_lists_and_pages_the_models_in_its_own_shape(gateway):
    async with anthropic_client(gateway, KEY) as claude:
        every = [m async for m in claude.models.list(limit=2)]  # the SDK follows the pages
        first = await claude.models.list(limit=2)
        chat = await claude.models.retrieve("chat")
        with pytest.raises(anthropic.NotFoundError) as missing:
            await claude.models.retrieve("no-such-model")
        with pytest.raises(anthropic.BadRequestError) as bad:
            await claude.models.list(limit=0)
    async with client(gateway) as alpha:
        assert [m.id for m in every] == [m.id async for m in alpha.models.list()]
    assert first.has_more and first.last_id == every[1].id and len(first.data) == 2
    assert (chat.type, chat.max_input_tokens, chat.max_tokens) == ("model", 256, 256)
    assert chat.created_at.year == 1970 and chat.display_name == "chat"
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"


async def test_each_variant_is_answered_by_its_own_pool(gateway):
    async with client(gateway) as alpha:
        seen = Counter()
        for i in range(40):
            raw = await alpha.chat.completions.with_raw_response.create(**ask("chat", f"q{i}"))
            variant, backend = raw.headers["x-forge-variant"], raw.headers["x-forge-backend"]
            assert backend == {"stable": "primary", "canary": "canary"}[variant]
            seen[variant] += 1
    assert seen["stable"] and seen["canary"]


async def test_a_live_weight_change_applies_to_the_next_request(gateway):
    """Through ``reconfigure``, what Serve calls with a changed user_config (that it replaces
    no replica under Serve: the drill, ``loadtest/traffic_policy.py``)."""
    promoted = {
        **SPLIT,
        "variants": [
            {**v, "weight": 100.0 if v["name"] == "canary" else 0.0} for v in SPLIT["variants"]
        ],
    }
    await gateway.reconfigure({"tenants": forge_args()["tenants"], "models": [promoted, CHAINED]})
    async with client(gateway) as alpha:
        for i in range(10):
            raw = await alpha.chat.completions.with_raw_response.create(**ask("chat", f"q{i}"))
            assert raw.headers["x-forge-variant"] == "canary"


async def test_the_chain_routes_around_an_open_breaker_to_the_smaller_pool(gateway):
    gateway.breakers.trip("primary")
    assert gateway.breakers.state("primary") is State.OPEN
    async with client(gateway) as alpha:
        raw = await alpha.chat.completions.with_raw_response.create(**ask("chained"))
    assert raw.headers["x-forge-backend"] == "small"


async def test_a_failing_pool_goes_to_the_step_taken_on_errors_not_to_the_one_that_is_not(gateway):
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "error"})
    async with client(gateway) as alpha:
        raw = await alpha.chat.completions.with_raw_response.create(**ask("chained"))
    # small is taken on overload, breaker_open and context_length only: the error goes on past it.
    assert raw.headers["x-forge-backend"] == "fallback"


async def test_an_overloaded_pool_spills_to_the_next_step_at_once(monkeypatch):
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    metrics = RecordingMetrics()
    gateway = await started(forge_args(), metrics)
    async with gateway.lifespan(), client(gateway) as alpha:
        slots = gateway.lasting.slots["primary"]
        held = await slots.acquire("alpha", "interactive")  # the pool's only slot, held
        raw = await alpha.chat.completions.with_raw_response.create(**ask("chained"))
        assert raw.headers["x-forge-backend"] == "small"
        # The pool's own name has no chain: it waits for the slot as ever, and is not spilled.
        plain = asyncio.ensure_future(
            alpha.chat.completions.with_raw_response.create(**ask("forge-sim"))
        )
        await asyncio.sleep(0.2)
        assert not plain.done()
        slots.release(held.lease_id)
        assert (await plain).headers["x-forge-backend"] == "primary"
    assert metrics.spills.calls == [
        {"model": "chained", "source": "primary", "to": "small", "reason": "deadline"}
    ]


@pytest.fixture
async def strict_gateway(monkeypatch) -> AsyncIterator[Gateway]:
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    strict = {"name": "strict", "variants": [{"name": "main", "pool": "primary"}], "chain": []}
    gateway = await started(forge_args(SPLIT, CHAINED, strict))
    async with gateway.lifespan():
        yield gateway


async def test_a_prompt_too_long_for_the_pool_goes_to_the_larger_one_or_is_a_clear_400(
    strict_gateway,
):
    long_text = "word " * 400  # past primary's 256-token window
    async with client(strict_gateway) as alpha:
        raw = await alpha.chat.completions.with_raw_response.create(**ask("chained", long_text))
        assert raw.headers["x-forge-backend"] == "small"
        with pytest.raises(openai.BadRequestError) as refused:
            await alpha.chat.completions.create(**ask("strict", long_text))
    assert refused.value.body["code"] == "context_length_exceeded"
    assert "takes 256" in refused.value.body["message"]


async def test_a_prompt_too_long_for_the_variant_drawn_is_served_by_one_that_takes_it(gateway):
    """chat's stable variant (primary, 256 tokens) beside its canary (8,192): a long prompt
    drawn to stable was a 400 saying the longest window chat could route to was 256."""
    long_text = "word " * 400
    async with client(gateway) as alpha:
        variants = Counter()
        for _ in range(8):  # sticky per request: both variants are drawn
            raw = await alpha.chat.completions.with_raw_response.create(**ask("chat", long_text))
            variants[raw.headers["x-forge-variant"]] += 1
        assert variants == {"canary": 8}
        with pytest.raises(openai.BadRequestError) as refused:
            await alpha.chat.completions.create(**ask("chat", "word " * 9000))
    assert refused.value.body["code"] == "context_length_exceeded"
    assert "takes 8192" in refused.value.body["message"]  # the longest of every variant's


async def test_shadow_copies_change_neither_the_answer_nor_the_tenants_usage(monkeypatch):
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    shadowed = {
        "name": "chat",
        "variants": [{"name": "main", "pool": "primary"}],
        "shadow": {"pool": "canary", "percent": 100},
    }
    metrics = RecordingMetrics()
    gateway = await started(forge_args(shadowed), metrics)
    shadow_calls = metrics.shadow_requests.calls
    async with gateway.lifespan(), client(gateway) as alpha:
        raw = await alpha.chat.completions.with_raw_response.create(**ask("chat"))
        await eventually_async(lambda: shadow_calls, timeout_s=5, what="the shadow copy ends")
        assert shadow_calls == [{"model": "chat", "pool": "canary", "status": "ok"}]
        # A failing candidate fails its copies only: the tenant's answer is the pool's, as before.
        for replica in gateway.backends["canary"].replicas.values():
            replica.set_fault({"mode": "error"})
        failed = await alpha.chat.completions.with_raw_response.create(**ask("chat", "again"))
        await eventually_async(lambda: len(shadow_calls) == 2, timeout_s=5, what="the copy ends")
    assert shadow_calls[1]["status"] == "error"
    assert failed.status_code == 200 and failed.headers["x-forge-backend"] == "primary"
    assert raw.parse().model == "forge-sim"
    assert sum(metrics.shadow_tokens.values) > 0  # counted apart...
    tokens = zip(metrics.tokens.calls, metrics.tokens.values, strict=True)
    charged = sum(v for tags, v in tokens if tags["tenant"] == "alpha")
    usages = [raw.parse().usage, failed.parse().usage]
    # ...and the tenant charged exactly its two answers' usage, under the pool's model.
    assert charged == sum(u.prompt_tokens + u.completion_tokens for u in usages)
    assert {tags["model"] for tags in metrics.tokens.calls} == {"forge-sim"}


async def test_a_faulty_canary_is_aborted_and_traffic_returns_to_stable(monkeypatch):
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    watched = {
        **SPLIT,
        "analysis": {"canary": "canary", "stable": "stable", "min_requests": 5},
    }
    del watched["chain"]  # the pools' own: a failed canary request is retried on the fallback
    gateway = await started(forge_args(watched))
    for replica in gateway.backends["canary"].replicas.values():
        replica.set_fault({"mode": "error"})
    async with gateway.lifespan(), client(gateway) as alpha:

        async def variants(first: int, count: int) -> list[str]:
            served = []
            for i in range(first, first + count):
                raw = await alpha.chat.completions.with_raw_response.create(**ask("chat", f"q{i}"))
                served.append(raw.headers["x-forge-variant"])
            return served

        # The analysis judges every 20 outcomes (or second), once each variant has 5: the
        # split is random, so which of the judgements aborts is too; by the 60th, one has.
        before = await variants(0, 60)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(gateway.asgi_app()), base_url="http://forge.test"
        ) as http:
            answer = await http.get(
                "/admin/status", headers={"authorization": f"Bearer {ADMIN_KEY}"}
            )
        after = await variants(60, 20)
    traffic = answer.json()["traffic"]["chat"]
    assert traffic["aborted"] == ["canary"]
    assert traffic["verdict"]["decision"] == "abort"
    assert "error ratio" in traffic["verdict"]["reasons"][0]
    assert "canary" in before[:20] and set(after) == {"stable"}
    assert traffic["weights"] == {"stable": 50.0, "canary": 0.0}
    assert traffic["variants"]["canary"]["errors"] >= 5


async def test_a_responses_conversation_stays_on_its_variant_through_previous_response_id(
    monkeypatch,
):
    """Each turn names only the one before it; the stored history is restored before the
    variant is drawn, so every turn's opening (the sticky key) is the first turn's."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    gateway = await started(forge_args({**SPLIT, "sticky": "conversation"}, CHAINED))
    seen = []
    async with gateway.lifespan(), client(gateway) as alpha:
        for i in range(12):
            first = await alpha.responses.with_raw_response.create(
                model="chat", input=f"conversation {i}", max_output_tokens=4
            )
            variants = [first.headers["x-forge-variant"]]
            previous = first.parse().id
            for _ in range(3):
                turn = await alpha.responses.with_raw_response.create(
                    model="chat",
                    input="and then?",
                    previous_response_id=previous,
                    max_output_tokens=4,
                )
                variants.append(turn.headers["x-forge-variant"])
                previous = turn.parse().id
            assert len(set(variants)) == 1, variants
            seen.append(variants[0])
    assert set(seen) == {"stable", "canary"}  # and the conversations did split
