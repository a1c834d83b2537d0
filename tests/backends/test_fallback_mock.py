"""The fallback's two production auth modes over real HTTP, against the mock OpenAI server.

The API-key mode is Gemini's OpenAI-compatible endpoint with a key from a secret; the metadata
mode is Vertex AI's with a workload-identity token. The mock checks the bearer like both do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
import pytest

from serve_app.backends.fallback import FallbackBackend
from serve_app.config.models import FallbackConfig
from serve_app.errors import ForgeError
from serve_app.mock_openai import create_mock_app
from tests.backends.loopback import (
    TOKEN_PATH,
    FakeMetadataServer,
    RecordingHeaders,
    serve_on_loopback,
)

KEY_ENV = "FORGE_TEST_MOCK_FALLBACK_KEY"
MODEL = "mock-gemini"
CHAT = {"model": "forge-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@asynccontextmanager
async def mock_upstream(api_key: str) -> AsyncIterator[tuple[str, RecordingHeaders]]:
    """The mock on loopback, requiring ``api_key``; its base URL and the headers it saw."""
    upstream = RecordingHeaders(create_mock_app(MODEL, {}, api_key=api_key))
    async with serve_on_loopback(upstream) as url:
        yield url + "/v1/", upstream


@pytest.fixture
async def gemini_like() -> AsyncIterator[tuple[str, RecordingHeaders]]:
    """The mock, requiring the bearer key ``sk-gemini-test``."""
    async with mock_upstream("sk-gemini-test") as upstream:
        yield upstream


async def stream_text(backend: FallbackBackend) -> bytes:
    batches = [b async for b in backend.stream({**CHAT, "stream": True}, "chat", "req-1")]
    return b"".join(item for batch in batches for item in batch if type(item) is bytes)


async def test_api_key_mode_sends_the_secret_as_a_bearer_key(gemini_like, monkeypatch):
    base_url, upstream = gemini_like
    monkeypatch.setenv(KEY_ENV, "sk-gemini-test")
    backend = FallbackBackend(FallbackConfig(base_url=base_url, model=MODEL, api_key_env=KEY_ENV))
    try:
        assert b"chat.completion.chunk" in await stream_text(backend)
        result = await backend.complete(CHAT, "chat", "req-2")
        assert result["response"]["model"] == MODEL
        assert await backend.ready() is True
    finally:
        await backend.aclose()
    assert [h["authorization"] for h in upstream.seen] == ["Bearer sk-gemini-test"] * 3


@pytest.mark.parametrize("configured", ["sk-wrong", None])
async def test_a_wrong_or_missing_key_is_the_gateways_502(gemini_like, monkeypatch, configured):
    """The provider's 401 is about Forge, not the client: a 502 the gateway fails over on."""
    base_url, upstream = gemini_like
    if configured:
        monkeypatch.setenv(KEY_ENV, configured)
        config = FallbackConfig(base_url=base_url, model=MODEL, api_key_env=KEY_ENV)
    else:
        config = FallbackConfig(base_url=base_url, model=MODEL)  # auth "none": no header
    backend = FallbackBackend(config)
    try:
        for call in (stream_text(backend), backend.complete(CHAT, "chat", "req-2")):
            with pytest.raises(ForgeError) as info:
                await call
            assert (info.value.status, info.value.code) == (502, "bad_gateway")
            assert "refused Forge's credentials (HTTP 401)" in info.value.message
            assert "sk-" not in info.value.message
    finally:
        await backend.aclose()
    assert len(upstream.seen) == 2


@pytest.fixture
async def vertex_like() -> AsyncIterator[tuple[str, str, FakeMetadataServer]]:
    """The mock, accepting only the first token the fake metadata server issues."""
    metadata = FakeMetadataServer()
    async with serve_on_loopback(metadata.app) as metadata_url:
        async with mock_upstream("token-1") as (base_url, _):
            yield base_url, metadata_url + TOKEN_PATH, metadata


async def test_metadata_mode_sends_the_workload_identity_token(vertex_like):
    base_url, metadata_url, metadata = vertex_like
    config = FallbackConfig(
        base_url=base_url, model=MODEL, auth="gcp_metadata", metadata_url=metadata_url
    )
    backend = FallbackBackend(config)
    try:
        assert b"chat.completion.chunk" in await stream_text(backend)
        assert (await backend.complete(CHAT, "chat", "req-2"))["response"]["model"] == MODEL
    finally:
        await backend.aclose()
    assert len(metadata.requests) == 1  # one token served both requests


async def test_metadata_mode_without_a_token_is_a_502_and_not_ready(vertex_like):
    base_url, metadata_url, metadata = vertex_like
    metadata.fail_with = 500
    config = FallbackConfig(
        base_url=base_url, model=MODEL, auth="gcp_metadata", metadata_url=metadata_url
    )
    backend = FallbackBackend(config)
    try:
        with pytest.raises(ForgeError) as info:
            await stream_text(backend)
        assert info.value.status == 502
        assert "credentials unavailable" in info.value.message
        assert await backend.ready() is False
    finally:
        await backend.aclose()


# What an agent sends that Gemini's OpenAI endpoint refuses: vLLM's sampling extensions, and
# OpenAI fields it does not document.
UNTAKEN = {
    "top_k": 20,
    "ignore_eos": False,
    "repetition_penalty": 1.1,
    "user": "agent-7",
    "logit_bias": {"50256": -100},
    "parallel_tool_calls": True,
}


async def test_a_failover_drops_what_the_fallback_refuses_and_keeps_what_it_takes(
    gemini_like, monkeypatch
):
    base_url, _ = gemini_like
    monkeypatch.setenv(KEY_ENV, "sk-gemini-test")
    body = CHAT | UNTAKEN | {"seed": 7, "stop": ["zzz"], "temperature": 0.2}
    taken = FallbackBackend(FallbackConfig(base_url=base_url, model=MODEL, api_key_env=KEY_ENV))
    forwarded = FallbackBackend(
        FallbackConfig(base_url=base_url, model=MODEL, api_key_env=KEY_ENV, accepted_params=None)
    )
    try:
        result = await taken.complete(body, "chat", "req-ok")
        assert result["response"]["choices"][0]["message"]["content"]
        # The mock refuses them as Gemini does: forwarded untouched, the failover would fail.
        with pytest.raises(ForgeError) as info:
            await forwarded.complete(body, "chat", "req-refused")
        assert "Unknown name" in info.value.message
    finally:
        await taken.aclose()
        await forwarded.aclose()
    sent = orjson.loads(taken._upstream_body(body, stream=False))
    assert not set(UNTAKEN) & set(sent)
    assert (sent["seed"], sent["stop"], sent["model"]) == (7, ["zzz"], MODEL)
