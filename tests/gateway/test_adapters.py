"""LoRA adapters through the gateway's HTTP surface, in one process (``serve_app/local.py``):
the official ``openai`` client, real replicas on the simulated engine, the real cache, ledger
and usage report. What a tenant sees of an adapter: bound, by name, by alias; a 404 naming an
unknown one; its own line in usage, priced per adapter; never the base model's cached answer."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import openai
import orjson
import pytest

from serve_app.admin.usage_report import _costed
from serve_app.auth.keys import hash_key
from serve_app.config.models import load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.mock_openai import create_mock_app
from tests.polling import eventually_async

BOUND, PLAIN, OTHER, ADMIN = "sk-test-bound", "sk-test-plain", "sk-test-other", "sk-test-adm"
UPSTREAM_KEY, KEY_ENV = "sk-test-upstream", "FORGE_TEST_ADAPTERS_UPSTREAM_KEY"
MODEL = "forge-sim"
FAST = {"prefill_base_s": 0.0, "decode_base_s": 0.0, "output_tokens_min": 6, "output_tokens_max": 6}
PRICE = {"prompt_per_million": 1.0, "completion_per_million": 2.0}
ADAPTER_PRICE = {"prompt_per_million": 10.0, "completion_per_million": 20.0}


def forge_args(tmp_path) -> dict:
    return {
        "tenants": [
            {"name": "bound", "key_hashes": [hash_key(BOUND)], "adapters": {MODEL: "support"}},
            {"name": "plain", "key_hashes": [hash_key(PLAIN)]},
            # May call the base model only: no adapter's name, and not the legal one's.
            {"name": "other", "key_hashes": [hash_key(OTHER)], "models": [MODEL]},
        ],
        "admin": {"key_hashes": [hash_key(ADMIN)]},
        "pools": [
            {
                "name": "primary",
                "model": MODEL,
                "engine": {**FAST, "max_loras": 2},
                "adapters": [
                    {"name": "support", "path": "/weights/adapters/support"},
                    {"name": "legal", "path": "/weights/adapters/legal", "tenants": ["plain"]},
                ],
            }
        ],
        "models": [
            {
                "name": "helpdesk",
                "variants": [{"name": "v1", "pool": "primary", "adapter": "support"}],
            }
        ],
        "fallback": {
            "base_url": "http://upstream.test/v1",
            "model": "mock-gemini",
            "api_key_env": KEY_ENV,
        },
        "metering": {
            "sqlite_path": str(tmp_path / "usage.sqlite3"),
            "flush_s": 0.01,
            "prices": {MODEL: PRICE, f"{MODEL}:legal": ADAPTER_PRICE},
        },
        "cache": {"enabled": True},
        "faults": {"enabled": True},
    }


@pytest.fixture
async def gateway(monkeypatch, tmp_path) -> AsyncIterator[Gateway]:
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    transport = httpx.ASGITransport(create_mock_app("mock-gemini", FAST, api_key=UPSTREAM_KEY))
    gateway = build_local_gateway(load_config(forge_args(tmp_path)), fallback_transport=transport)
    async with gateway.lifespan():
        yield gateway


def client(gateway: Gateway, key: str) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(gateway.asgi_app()), base_url="http://forge.test"
    )
    return openai.AsyncOpenAI(
        base_url="http://forge.test/v1", api_key=key, http_client=http, max_retries=0
    )


def ask(model: str, text: str = "Hello, Forge", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


async def answer(api: openai.AsyncOpenAI, model: str, **extra) -> str:
    return (await api.chat.completions.create(**ask(model, **extra))).choices[0].message.content


async def test_a_bound_tenant_gets_its_adapter_as_does_anyone_calling_it_by_name(gateway, caplog):
    caplog.set_level(logging.INFO, logger="ray.serve.forge.access")
    async with client(gateway, BOUND) as bound, client(gateway, PLAIN) as plain:
        base = await answer(plain, MODEL)
        by_name = await answer(plain, f"{MODEL}:support")
        by_alias = await answer(plain, "helpdesk")
        bound_base = await answer(bound, MODEL)
        legal = await answer(plain, f"{MODEL}:legal")
        streamed = await bound.chat.completions.create(**ask(MODEL), stream=True)
        bound_streamed = "".join([c.choices[0].delta.content or "" async for c in streamed])
    assert by_name != base  # an adapter's answer is its own...
    assert bound_base == by_name == by_alias == bound_streamed  # ...however it is reached
    assert legal not in (base, by_name)
    # The access log says which adapter served the bound tenant's request for the model.
    lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name.endswith("access")]
    assert {(x["model"], x["adapter"]) for x in lines if x["tenant"] == "bound"} == {
        (MODEL, "support")
    }


async def test_an_unknown_adapter_is_a_404_naming_it_and_a_forbidden_one_is_unknown(gateway):
    async with client(gateway, PLAIN) as plain, client(gateway, OTHER) as other:
        with pytest.raises(openai.NotFoundError) as unknown:
            await plain.chat.completions.create(**ask(f"{MODEL}:nope"))
        with pytest.raises(openai.NotFoundError) as not_hers:
            await other.chat.completions.create(**ask(f"{MODEL}:support"))
        with pytest.raises(openai.NotFoundError) as not_listed:
            await other.chat.completions.create(**ask(f"{MODEL}:legal"))
    assert unknown.value.body["code"] == "model_not_found"
    assert unknown.value.body["message"].startswith(f"The adapter `nope` of model `{MODEL}`")
    # Not hers to call: told exactly as an unknown name is, whether it exists or not.
    assert not_hers.value.body["message"] == not_listed.value.body["message"].replace(
        "legal", "support"
    )
    assert not_hers.value.body["message"].startswith(f"The model `{MODEL}:support`")


async def test_models_lists_the_adapters_each_tenant_may_call(gateway):
    async def listed(key: str) -> list[str]:
        async with client(gateway, key) as api:
            return [m.id async for m in api.models.list()]

    everything = [MODEL, "mock-gemini", "helpdesk", f"{MODEL}:support", f"{MODEL}:legal"]
    assert await listed(PLAIN) == everything
    assert await listed(BOUND) == everything[:-1]  # legal is plain's alone
    assert await listed(OTHER) == [MODEL]  # its allow-list names no adapter


async def test_an_adapters_request_never_fails_over_to_the_fallback(gateway):
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "error"})
    async with client(gateway, PLAIN) as plain:
        base = await plain.chat.completions.with_raw_response.create(**ask(MODEL))
        with pytest.raises(openai.APIStatusError) as failed:
            await plain.chat.completions.create(**ask(f"{MODEL}:support"))
    assert base.headers["x-forge-backend"] == "fallback"  # the base model's may
    assert failed.value.status_code >= 500  # the fallback's answer would be no adapter's


async def test_the_cache_keys_by_adapter(gateway):
    store = gateway.store

    async def kept(before: int) -> None:
        await eventually_async(
            lambda: store.cache_bytes > before, timeout_s=10, what="the answer is kept"
        )

    async with client(gateway, PLAIN) as plain:
        base = await plain.chat.completions.with_raw_response.create(**ask(MODEL, temperature=0))
        await kept(0)
        held = store.cache_bytes
        first = await plain.chat.completions.with_raw_response.create(
            **ask(f"{MODEL}:support", temperature=0)
        )
        await kept(held)
        again = await plain.chat.completions.with_raw_response.create(
            **ask(f"{MODEL}:support", temperature=0)
        )
    assert base.headers["x-forge-cache"] == "miss"
    assert first.headers["x-forge-cache"] == "miss"  # not the base model's answer replayed
    assert again.headers["x-forge-cache"] == "hit"
    assert first.parse().choices[0].message.content != base.parse().choices[0].message.content
    assert again.parse().choices[0].message.content == first.parse().choices[0].message.content


async def test_usage_has_a_line_per_adapter_priced_as_the_adapter(gateway):
    async with client(gateway, BOUND) as bound, client(gateway, PLAIN) as plain:
        await answer(bound, MODEL)
        await answer(plain, f"{MODEL}:legal")
        await answer(plain, MODEL)
    await eventually_async(lambda: gateway.ledger.queued, timeout_s=5, what="usage queued")
    await gateway.ledger.flush()
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(gateway.asgi_app()),
        base_url="http://forge.test",
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    async with http:
        data = (await http.get("/admin/usage", params={"group": "total"})).json()
    lines = {(r["tenant"], r["model"]): _costed(r, data["prices"]) for r in data["data"]}
    assert set(lines) == {
        ("bound", f"{MODEL}:support"),
        ("plain", f"{MODEL}:legal"),
        ("plain", MODEL),
    }
    support, legal = lines["bound", f"{MODEL}:support"], lines["plain", f"{MODEL}:legal"]
    assert support["adapter"] == "support" and legal["adapter"] == "legal"
    # legal has a price of its own; support has none, so it is its model's.
    assert legal["cost"] == pytest.approx(
        (legal["prompt_tokens"] * 10.0 + legal["completion_tokens"] * 20.0) / 1e6
    )
    assert support["cost"] == pytest.approx(
        (support["prompt_tokens"] * 1.0 + support["completion_tokens"] * 2.0) / 1e6
    )
