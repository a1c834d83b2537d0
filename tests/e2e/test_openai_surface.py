"""The OpenAI surface through the real graph, driven by the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import ALPHA_KEY, COLD_POOL

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "Tell me about gateways."}]


def test_chat_non_streaming_returns_text_and_exact_usage(openai_client):
    result = openai_client.chat.completions.create(model="forge-sim", messages=CHAT, max_tokens=5)
    assert result.object == "chat.completion"
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content.strip()
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 5
    assert result.usage.prompt_tokens > 0
    assert result.usage.total_tokens == result.usage.prompt_tokens + 5


def test_chat_is_deterministic_for_the_same_prompt(openai_client):
    texts = {
        openai_client.chat.completions.create(model="forge-sim", messages=CHAT, max_tokens=8)
        .choices[0]
        .message.content
        for _ in range(3)
    }
    assert len(texts) == 1


def test_chat_streaming_matches_non_streaming_text(openai_client):
    whole = openai_client.chat.completions.create(model="forge-sim", messages=CHAT, max_tokens=12)
    stream = openai_client.chat.completions.create(
        model="forge-sim",
        messages=CHAT,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len(chunks) > 3, "a stream arrives in many chunks, not one buffered body"
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert usage.completion_tokens == 12
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_without_include_usage_sends_no_usage_chunk(openai_client):
    chunks = list(
        openai_client.chat.completions.create(
            model="forge-sim", messages=CHAT, max_tokens=4, stream=True
        )
    )
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)


def test_sse_wire_format_ends_with_done(forge_url):
    body = {"model": "forge-sim", "messages": CHAT, "max_tokens": 3, "stream": True}
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    with httpx.stream(
        "POST", f"{forge_url}/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-forge-backend"] == "primary"
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_completions_streaming_and_not(openai_client):
    whole = openai_client.completions.create(model="forge-sim", prompt="Once upon", max_tokens=6)
    assert whole.object == "text_completion"
    assert whole.usage.completion_tokens == 6
    streamed = "".join(
        c.choices[0].text
        for c in openai_client.completions.create(
            model="forge-sim", prompt="Once upon", max_tokens=6, stream=True
        )
        if c.choices
    )
    assert streamed == whole.choices[0].text


def test_models_lists_pools_and_fallback(openai_client):
    ids = {m.id for m in openai_client.models.list()}
    assert ids == {
        "forge-sim",
        "forge-solo",
        "forge-chaos",
        "forge-cold",
        "forge-fair",
        "forge-prefix-affinity",
        "forge-kv-aware",
        "forge-metered",
        "forge-embed",
        "mock-gemini",
    }


def test_a_model_is_retrieved_by_its_name_and_an_unknown_one_is_a_404(openai_client):
    assert openai_client.models.retrieve("forge-sim").id == "forge-sim"
    with pytest.raises(openai.NotFoundError) as missing:
        openai_client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"


def test_fallback_model_is_served_over_http_by_the_mock(openai_client):
    raw = openai_client.chat.completions.with_raw_response.create(
        model="mock-gemini", messages=CHAT, max_tokens=4
    )
    assert raw.headers["x-forge-backend"] == "fallback"
    result = raw.parse()
    assert result.model == "mock-gemini"
    assert result.usage.completion_tokens == 4


def test_request_id_round_trip(openai_client):
    raw = openai_client.chat.completions.with_raw_response.create(
        model="forge-sim", messages=CHAT, max_tokens=2, extra_headers={"x-request-id": "trace-42"}
    )
    assert raw.headers.get_list("x-request-id") == ["trace-42"]
    # Inside, Forge keys the request by an id of its own (clients' ids repeat): the replica,
    # whose id the response carries, never saw the client's.
    assert "trace-42" not in raw.parse().id


def test_request_id_is_minted_when_absent(forge_url):
    response = httpx.post(
        f"{forge_url}/v1/chat/completions",
        json={"model": "forge-sim", "messages": CHAT, "max_tokens": 2},
        headers={"authorization": f"Bearer {ALPHA_KEY}"},
    )
    minted = response.headers.get_list("x-request-id")
    assert len(minted) == 1 and len(minted[0]) >= 16


def test_health_and_readiness(forge_url):
    assert httpx.get(f"{forge_url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{forge_url}/readyz")
    assert ready.status_code == 200
    backends = ready.json()["backends"]
    assert {"primary", "fallback", "kv-aware", COLD_POOL} <= set(backends)
    # Every backend is up but the pool scaled to zero, which is ready only once woken (as it
    # is when test_cold_start.py ran first).
    assert [name for name, up in backends.items() if not up] in ([], [COLD_POOL])
