"""SimulatedEngine: vLLM-shaped OpenAI chunks over SimulatedLLM, in pure asyncio (no Ray).

What every engine does is in the Engine contract (``test_engine_contract.py``); this file
keeps what is the simulator's own: its exact chunk layout, determinism and validation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import orjson
import pytest

from serve_app import tokenizer
from serve_app.config.models import SimulatedEngineConfig
from serve_app.engines.base import Usage
from serve_app.engines.simulated import SimulatedEngine
from serve_app.errors import ForgeError
from serve_app.protocol import prompt_text
from tests.polling import eventually_async

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}]}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time"}

EngineFactory = Callable[..., SimulatedEngine]


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    engines: list[SimulatedEngine] = []

    def make(default_max_tokens: int = 64, **config) -> SimulatedEngine:
        config = {"output_tokens_min": 4, "output_tokens_max": 12, **config}
        engine = SimulatedEngine(MODEL, SimulatedEngineConfig(**config), default_max_tokens)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.shutdown()


@pytest.fixture
def engine(make_engine: EngineFactory) -> SimulatedEngine:
    return make_engine()


async def collect(engine, body: dict, kind="chat", request_id="req-1") -> tuple[list[dict], Usage]:
    """The stream's frames decoded as JSON, and its final Usage; checks the item contract."""
    items = [item async for item in engine.stream(body, kind, request_id)]
    *frames, usage = items
    assert isinstance(usage, Usage)
    for frame in frames:
        assert type(frame) is bytes
        assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
        assert frame.count(b"\n\n") == 1
    return [orjson.loads(f[len(b"data: ") :]) for f in frames], usage


def content_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


async def test_chat_stream_frames_then_exactly_one_usage_last(engine):
    chunks, usage = await collect(engine, CHAT)
    assert len(chunks) == usage.completion_tokens + 2  # role chunk + one per token + finish
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert {c["id"] for c in chunks} == {"chatcmpl-req-1"}
    assert {c["model"] for c in chunks} == {MODEL}


async def test_role_chunk_first_then_content_then_finish(engine):
    chunks, _ = await collect(engine, CHAT)
    first = chunks[0]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""}
    assert first["finish_reason"] is None
    for chunk in chunks[1:-1]:
        choice = chunk["choices"][0]
        assert set(choice["delta"]) == {"content"} and choice["delta"]["content"]
        assert choice["finish_reason"] is None
    last = chunks[-1]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "stop"


async def test_stream_deltas_equal_complete_content(engine):
    chunks, usage = await collect(engine, CHAT)
    response, complete_usage = await engine.complete(CHAT, "chat", "req-2")
    assert content_of(chunks) == response["choices"][0]["message"]["content"]
    assert usage == complete_usage


async def test_complete_chat_response_shape(engine):
    response, usage = await engine.complete(CHAT, "chat", "abc")
    assert response["id"] == "chatcmpl-abc"
    assert response["object"] == "chat.completion"
    assert response["model"] == MODEL
    choice = response["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop"
    assert response["usage"] == usage.to_openai()
    assert response["usage"]["total_tokens"] == usage.prompt_tokens + usage.completion_tokens


async def test_include_usage_adds_usage_frame_and_null_usage_elsewhere(engine):
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    chunks, usage = await collect(engine, body)
    *token_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == usage.to_openai()
    assert usage_chunk["id"] == "chatcmpl-req-1"
    for chunk in token_chunks:
        assert "usage" in chunk and chunk["usage"] is None


async def test_without_include_usage_no_usage_anywhere(engine):
    chunks, usage = await collect(engine, {**CHAT, "stream": True})
    assert all("usage" not in c for c in chunks)
    assert all(c["choices"] for c in chunks)
    assert usage.completion_tokens > 0  # still reported to the gateway, for metering


async def test_completion_stream_frames_have_text(engine):
    chunks, usage = await collect(engine, COMPLETION, kind="completion")
    assert len(chunks) == usage.completion_tokens + 1  # no role chunk for completions
    assert all(c["object"] == "text_completion" for c in chunks)
    assert all("text" in c["choices"][0] and "delta" not in c["choices"][0] for c in chunks)
    assert chunks[0]["id"] == "cmpl-req-1"
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "text": "",
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": None,  # vLLM's: no stop string ended it
    }
    text = "".join(c["choices"][0]["text"] for c in chunks)
    response, _ = await engine.complete(COMPLETION, "completion", "req-2")
    assert response["object"] == "text_completion"
    assert response["choices"][0]["text"] == text


async def test_small_max_tokens_finishes_with_length(engine):
    chunks, usage = await collect(engine, {**CHAT, "max_tokens": 2})
    assert usage.completion_tokens == 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    response, _ = await engine.complete({**CHAT, "max_tokens": 2}, "chat", "r")
    assert response["choices"][0]["finish_reason"] == "length"


def test_prompt_text_of_completion_list():
    assert prompt_text({"prompt": ["only one"]}, "completion") == "only one"
    assert prompt_text(CHAT, "chat") == tokenizer.render_chat(CHAT["messages"])


async def test_prompt_over_max_model_len_is_400(make_engine):
    engine = make_engine(max_model_len=32)
    body = {"model": MODEL, "prompt": "word " * 40, "max_tokens": 1}
    with pytest.raises(ForgeError) as info:
        await collect(engine, body, kind="completion")
    err = info.value
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "prompt")
    assert "maximum context length is 32 tokens" in err.message
    with pytest.raises(ForgeError) as info:
        await engine.complete(body, "completion", "r")
    assert info.value.code == "context_length_exceeded"


async def test_request_larger_than_kv_cache_is_400(make_engine):
    engine = make_engine(num_kv_blocks=2, block_size=16)  # 32 tokens of cache, 8192 of context
    with pytest.raises(ForgeError) as info:
        await collect(engine, {**CHAT, "max_tokens": 100})
    assert (info.value.status, info.value.code) == (400, "context_length_exceeded")


async def test_same_client_request_id_concurrently(make_engine):
    engine = make_engine(decode_base_s=0.001)
    (a, usage_a), (b, usage_b) = await asyncio.gather(
        collect(engine, CHAT, request_id="dup"), collect(engine, CHAT, request_id="dup")
    )
    assert usage_a == usage_b and usage_a.completion_tokens > 0
    assert content_of(a) == content_of(b)
    assert a[0]["id"] == b[0]["id"] == "chatcmpl-dup"  # the client's id is kept in the output


async def test_ignore_eos_generates_exactly_max_tokens(engine):
    chunks, usage = await collect(engine, {**CHAT, "ignore_eos": True, "max_tokens": 200})
    assert usage.completion_tokens == 200
    assert len([c for c in chunks if c["choices"][0]["delta"].get("content")]) == 200
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_same_seed_same_text_different_seed_differs(engine):
    body = {**CHAT, "max_tokens": 12}
    first, _ = await collect(engine, {**body, "seed": 1})
    again, _ = await collect(engine, {**body, "seed": 1})
    other, _ = await collect(engine, {**body, "seed": 2})
    assert content_of(first) == content_of(again)
    assert content_of(first) != content_of(other)


async def test_an_abandoned_stream_reports_what_the_engine_generated(make_engine):
    """The client leaves after 3 tokens; tokens already generated but never read count too,
    exactly as the engine's own counters do: that is what the tenant is charged."""
    engine = make_engine(decode_base_s=0.001)
    body = {**CHAT, "max_tokens": 500, "ignore_eos": True}
    stream = engine.stream(body, "chat", "gone-1")
    read = 0
    async for item in stream:
        read += isinstance(item, bytes)
        if read == 4:  # the role chunk and 3 tokens
            break
    await eventually_async(  # steps run on: generated, never read
        lambda: engine.stats().generation_tokens >= 6,  # 3 tokens read, 3 more not
        timeout_s=5,
        what="the engine to generate past what was read",
        explain=engine.stats,
    )
    await stream.aclose()
    usage = await engine.abandoned.collect("gone-1", wait_s=1.0)
    stats = engine.stats()
    assert usage is not None
    assert usage.completion_tokens == stats.generation_tokens > 3
    assert (
        usage.prompt_tokens
        == stats.prompt_tokens
        == len(tokenizer.encode(prompt_text(body, "chat")))
    )
    assert await engine.abandoned.collect("gone-1", wait_s=0.01) is None  # collected once


async def test_a_finished_stream_leaves_nothing_to_collect(engine):
    await collect(engine, CHAT, request_id="done-1")
    assert await engine.abandoned.collect("done-1", wait_s=0.05) is None


async def test_collect_waits_for_an_abort_that_lands_after_the_question(make_engine):
    engine = make_engine(decode_base_s=0.001)
    body = {**CHAT, "max_tokens": 500, "ignore_eos": True}
    stream = engine.stream(body, "chat", "late-1")
    await anext(stream)
    asked = asyncio.create_task(engine.abandoned.collect("late-1", wait_s=2.0))
    await asyncio.sleep(0)  # a loop turn: it asks, and then waits for the abort, not for time
    assert not asked.done()
    await stream.aclose()
    usage = await asked
    assert usage is not None and usage.completion_tokens == engine.stats().generation_tokens


async def test_embeddings_take_slots_and_prefill_but_generate_nothing(make_engine):
    """As vLLM's pooling runner: each input is a request (a slot, its prompt prefilled and
    counted, the prefix cache queried), and no generated token is counted."""
    engine = make_engine(max_num_seqs=2, prefill_base_s=0.01, embedding_dim=32)
    inputs = ["one two three", "four five", "six seven eight nine"]
    body = {"model": MODEL, "input": inputs}
    running = []

    async def watch() -> None:
        while True:
            running.append(engine.stats().num_requests_running)
            # A sampler, not a wait: a fifth of a step, and timers fire in deadline order.
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    response, usage = await engine.complete(body, "embedding", "emb-1")
    watcher.cancel()
    stats = engine.stats()
    tokens = sum(tokenizer.count_tokens(text) for text in inputs)
    assert usage == Usage(tokens, 0, 0)
    assert response["usage"]["prompt_tokens"] == tokens
    assert [len(item["embedding"]) for item in response["data"]] == [32, 32, 32]
    assert max(running) == 2  # three inputs, two slots: batched, never over the engine's size
    assert stats.prompt_tokens == stats.prefix_cache_queries == tokens
    assert stats.generation_tokens == 0


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    "extra",
    [{}, {"stop": [" the"]}, {"tools": [WEATHER], "tool_choice": "required"}],
    ids=["text", "stop-string", "tool-call"],
)
async def test_a_stream_left_at_any_item_once_the_engine_is_done_is_charged_once(
    make_engine: EngineFactory, extra: dict
):
    """A caller slower than the engine (the replica's bounded queue makes it wait) may leave at
    any item, after the engine finished: what it cost is recorded exactly once, and in full."""
    engine = make_engine(output_tokens_min=30, output_tokens_max=30)
    body = {**CHAT, "stream_options": {"include_usage": True}, **extra}
    reference = [item async for item in engine.stream(body, "chat", "ref")]
    final = reference[-1]
    assert isinstance(final, Usage)
    for cut in range(1, len(reference)):  # the caller took `cut` items, never the Usage
        request_id = f"cut-{cut}"
        stream = engine.stream(body, "chat", request_id)
        for _ in range(cut):
            await anext(stream)
        await eventually_async(
            lambda: engine.llm.num_requests_running + engine.llm.num_requests_waiting == 0,
            timeout_s=5,
            what="the engine to be done with the request",
        )
        await stream.aclose()
        usage = await engine.abandoned.collect(request_id, 1.0)
        assert usage is not None, f"left after {cut} items: not charged"
        assert usage.prompt_tokens == final.prompt_tokens
        if "stop" in extra:
            # Left before the stop string reached it, the engine generated on (merged).
            assert final.completion_tokens <= usage.completion_tokens <= 30
        else:  # (its prompt is in the prefix cache by now: cached_tokens differ)
            assert usage.completion_tokens == final.completion_tokens, f"left after {cut} items"
        assert await engine.abandoned.collect(request_id, 0.0) is None, "charged once"
