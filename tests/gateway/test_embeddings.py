"""``/v1/embeddings`` through the whole gateway, in process: the official ``openai`` client over
httpx's ``ASGITransport`` into a ``Gateway`` with a generation pool, an embedding pool
(``task: embed``, the simulated engine) and the mock fallback.

What a user sees: vectors in both encodings the client asks for, the quota charged the input's
tokens (nothing reserved for output), the request metered under the embedding model, the wrong
route named, and no failover: another model's vectors would not match an index built from this
pool's, so a failing embedding pool is an error, never the fallback's answer.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator

import httpx
import numpy as np
import openai
import pytest

from serve_app import tokenizer
from serve_app.auth.keys import hash_key
from serve_app.config.models import load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.mock_openai import create_mock_app

KEY = "sk-test-embed"
SMALL_KEY = "sk-test-embed-small"
UPSTREAM_KEY = "sk-test-upstream"
KEY_ENV = "FORGE_TEST_EMBED_UPSTREAM_KEY"
CHAT_MODEL = "forge-sim"
EMBED_MODEL = "forge-embed"
FAST = {"prefill_base_s": 0.0, "decode_base_s": 0.0, "output_tokens_min": 4, "output_tokens_max": 8}
DIM = 64
SMALL_TPM = 40


def forge_args() -> dict:
    return {
        "tenants": [
            {"name": "alpha", "key_hashes": [hash_key(KEY)], "limits": {"tpm": 100_000}},
            {"name": "small", "key_hashes": [hash_key(SMALL_KEY)], "limits": {"tpm": SMALL_TPM}},
        ],
        "pools": [
            {"name": "chat", "model": CHAT_MODEL, "engine": FAST},
            {
                "name": "embed",
                "model": EMBED_MODEL,
                "task": "embed",
                "engine": {**FAST, "embedding_dim": DIM, "max_model_len": 256},
                "admission": {"max_inflight": 2},
                "deployment": {"num_replicas": 2},
            },
        ],
        "fallback": {
            "base_url": "http://upstream.test/v1",
            "model": "mock-gemini",
            "api_key_env": KEY_ENV,
        },
        "metering": {"flush_s": 0.01},
    }


@pytest.fixture
async def gateway(monkeypatch) -> AsyncIterator[Gateway]:
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    upstream = httpx.ASGITransport(create_mock_app("mock-gemini", FAST, api_key=UPSTREAM_KEY))
    gateway = build_local_gateway(load_config(forge_args()), fallback_transport=upstream)
    async with gateway.lifespan():
        yield gateway


def http(gateway: Gateway, key: str = KEY) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(gateway.asgi_app()),
        base_url="http://forge.test",
        headers={"authorization": f"Bearer {key}"},
    )


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url="http://forge.test/v1", api_key=KEY, http_client=http(gateway), max_retries=0
    ) as client:
        yield client


TEXTS = ["the cat sat on the mat", "the cat sat on a mat today", "quarterly revenue forecast"]


async def test_the_openai_client_gets_one_unit_vector_per_input(client):
    # The client asks for base64 unless told otherwise, and decodes it: both encodings agree.
    packed = await client.embeddings.create(model=EMBED_MODEL, input=TEXTS)
    floats = await client.embeddings.create(model=EMBED_MODEL, input=TEXTS, encoding_format="float")
    assert [item.index for item in packed.data] == [0, 1, 2]
    vectors = np.array([item.embedding for item in floats.data])
    assert vectors.shape == (3, DIM)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.allclose(np.array([item.embedding for item in packed.data]), vectors, atol=1e-6)
    # A bag of tokens: texts that share words are nearer than texts that share none.
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]
    expected = sum(tokenizer.count_tokens(text) for text in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == expected
    assert floats.model == EMBED_MODEL


async def test_the_same_input_embeds_the_same_on_any_replica(client):
    first = await client.embeddings.create(model=EMBED_MODEL, input=TEXTS[0])
    for _ in range(3):  # two replicas: some of these land on the other one
        again = await client.embeddings.create(model=EMBED_MODEL, input=TEXTS[0])
        assert again.data[0].embedding == first.data[0].embedding


async def test_token_ids_and_dimensions(client):
    ids = tokenizer.encode(TEXTS[0])
    by_ids = await client.embeddings.create(model=EMBED_MODEL, input=ids, encoding_format="float")
    by_text = await client.embeddings.create(
        model=EMBED_MODEL, input=TEXTS[0], encoding_format="float"
    )
    assert by_ids.data[0].embedding == pytest.approx(by_text.data[0].embedding)
    assert by_ids.usage.prompt_tokens == len(ids)

    short = await client.embeddings.create(
        model=EMBED_MODEL, input=TEXTS[0], dimensions=16, encoding_format="float"
    )
    vector = np.array(short.data[0].embedding)
    assert vector.shape == (16,) and np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": EMBED_MODEL, "input": ""}, "input"),
        ({"model": EMBED_MODEL, "input": []}, "input"),
        ({"model": EMBED_MODEL, "input": [[1, 2], []]}, "input"),
        ({"model": EMBED_MODEL}, "input"),
        ({"model": EMBED_MODEL, "input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"model": EMBED_MODEL, "input": "hi", "dimensions": DIM + 1}, "dimensions"),
        ({"model": EMBED_MODEL, "input": "word " * 300}, "input"),  # past max_model_len
        ({"model": CHAT_MODEL, "input": "hi"}, "model"),  # a generation model
    ],
)
async def test_bad_embedding_requests_are_openai_400s(gateway, body, param):
    async with http(gateway) as h:
        response = await h.post("/v1/embeddings", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


async def test_chat_with_an_embedding_model_is_named_and_unknown_models_are_404(gateway):
    async with http(gateway) as h:
        chat = await h.post(
            "/v1/chat/completions",
            json={"model": EMBED_MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        unknown = await h.post("/v1/embeddings", json={"model": "nope", "input": "hi"})
    assert chat.status_code == 400
    assert chat.json()["error"]["code"] == "unsupported_model"
    assert "/v1/embeddings" in chat.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


async def test_the_quota_is_charged_the_inputs_tokens_and_nothing_for_output(gateway):
    text = "alpha beta gamma delta epsilon"  # 5 tokens by the gateway's count
    async with http(gateway, SMALL_KEY) as h:
        first = await h.post("/v1/embeddings", json={"model": EMBED_MODEL, "input": text})
        assert first.status_code == 200, first.text
        assert int(first.headers["x-ratelimit-remaining-tokens"]) == SMALL_TPM - 5
        too_big = await h.post(
            "/v1/embeddings", json={"model": EMBED_MODEL, "input": "word " * (SMALL_TPM + 1)}
        )
    assert too_big.status_code == 400
    assert too_big.json()["error"]["code"] == "request_exceeds_token_budget"
    assert too_big.json()["error"]["param"] == "input"


async def test_embeddings_are_metered_under_the_embedding_model(gateway, client):
    answer = await client.embeddings.create(model=EMBED_MODEL, input=TEXTS[:2])
    yesterday = (dt.datetime.now(dt.UTC).date() - dt.timedelta(days=1)).isoformat()
    async with http(gateway) as h:
        for _ in range(500):  # metering writes off the request path
            rows = (await h.get("/v1/usage", params={"start": yesterday, "group": "total"})).json()
            if rows["data"]:
                break
            await asyncio.sleep(0.01)
    (line,) = rows["data"]
    assert (line["model"], line["requests"]) == (EMBED_MODEL, 1)
    assert line["prompt_tokens"] == answer.usage.prompt_tokens
    assert line["completion_tokens"] == 0


async def test_a_failing_embedding_pool_is_never_served_by_the_fallback(gateway, client):
    for replica in gateway.backends["embed"].replicas.values():
        replica.set_fault({"mode": "error"})
    with pytest.raises(openai.APIStatusError) as failed:
        await client.embeddings.create(model=EMBED_MODEL, input="hello")
    assert failed.value.status_code >= 500
    assert failed.value.response.headers.get("x-forge-backend") != "fallback"
    # The chat pool's model still fails over as before.
    for replica in gateway.backends["chat"].replicas.values():
        replica.set_fault({"mode": "error"})
    raw = await client.chat.completions.with_raw_response.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert raw.headers["x-forge-backend"] == "fallback"


def test_an_embedding_pool_that_asks_for_a_fallback_is_refused():
    args = forge_args()
    args["pools"][1]["fallback"] = True
    with pytest.raises(ValueError, match="cannot fail over"):
        load_config(args)


async def test_models_lists_the_embedding_model(client):
    models = {m.id for m in (await client.models.list()).data}
    assert {CHAT_MODEL, EMBED_MODEL} <= models
