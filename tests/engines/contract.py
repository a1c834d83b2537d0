"""One contract, every engine: what a replica relies on from ``Engine`` (``engines/base.py``).

``EngineContract`` holds the tests; a run subclasses it (``TestXxx(EngineContract)``) and
provides two fixtures: ``engine``, the started engine under test, and ``spec``, what that engine
was configured with (an ``EngineSpec``). The simulated engine runs it in
``tests/engines/test_engine_contract.py``, the real vLLM in
``tests/vllm/test_engine_contract_vllm.py``. Each engine's own test file keeps what is specific
to it (the simulator's determinism, vLLM's Prometheus series).

Everything here must hold for a tiny random-weights model, whose text is gibberish and whose
end-of-sequence token can come at any step: the tests assert shapes and counts, never content,
and ask for ``ignore_eos`` wherever they need an exact token count. Bodies are what the gateway
forwards: ``stream`` is true for ``Engine.stream`` and false for ``Engine.complete``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields

import orjson
import pytest

from serve_app.engines.base import Engine, EngineStats, Kind, Usage
from serve_app.engines.truncation import TRUNCATE_KEY, fit_conversation
from serve_app.errors import ForgeError
from tests.polling import eventually_async

KINDS: tuple[Kind, ...] = ("chat", "completion")
MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]
PROMPT = "The quick brown fox"
SHORT = 8  # max_tokens of an ordinary test request
# Many seconds of decoding on vLLM's CPU build: still running when a test walks away from it.
LONG_GENERATION = 1800
# Many KV blocks long on every engine, and sent by one test only, so it starts uncached.
CACHED_PROMPT = "A prefix cache keeps the key and value blocks of the prompts it has seen. " * 20


@dataclass(frozen=True)
class EngineSpec:
    """What the engine under test was configured with, and how soon its stats catch up."""

    model: str  # the served model name, echoed in every response
    default_max_tokens: int  # the pool's default, for requests that name no limit
    max_num_seqs: int
    max_model_len: int
    block_size: int  # KV-cache block, in tokens: prefix-cache hits come in whole blocks
    count_prompt_tokens: Callable[[dict, Kind], int]  # the engine's own tokenizer and template
    # How long ``stats()`` may lag behind the requests: 0 means exact at every moment (checked
    # once, no waiting); vLLM's stat logger hears from its scheduler once per engine step.
    settle_s: float = 0.0
    poll_interval_s: float = 0.0  # 0: check again after one event-loop turn


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def request_body(
    spec: EngineSpec,
    kind: Kind,
    *,
    stream: bool,
    max_tokens: int | None = SHORT,
    ignore_eos: bool = True,
    **extra,
) -> dict:
    body: dict = {"model": spec.model, "stream": stream}
    body |= {"messages": MESSAGES} if kind == "chat" else {"prompt": PROMPT}
    if ignore_eos:
        body["ignore_eos"] = True
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body | extra


async def collect(
    engine: Engine, body: dict, kind: Kind, request_id: str = "req"
) -> tuple[list[dict], Usage]:
    """The stream's frames as JSON and its Usage; checks the item contract of ``stream``."""
    items = [item async for item in engine.stream(body, kind, request_id)]
    usages = [item for item in items if isinstance(item, Usage)]
    assert len(usages) == 1 and items[-1] is usages[0], "exactly one Usage, as the last item"
    frames = items[:-1]
    for frame in frames:
        assert type(frame) is bytes
        # One SSE event per frame, each a JSON object: never the gateway's `data: [DONE]`.
        assert frame.startswith(b"data: {") and frame.endswith(b"\n\n")
        assert frame.count(b"\n\n") == 1
    return [orjson.loads(frame[len(b"data: ") :]) for frame in frames], usages[0]


async def run_once(
    engine: Engine, body: dict, kind: Kind, request_id: str, streamed: bool
) -> tuple[Usage, str]:
    """Usage and finish reason of one request, through ``stream`` or ``complete``."""
    if streamed:
        chunks, usage = await collect(engine, {**body, "stream": True}, kind, request_id)
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        return usage, reasons[-1]
    response, usage = await engine.complete({**body, "stream": False}, kind, request_id)
    return usage, response["choices"][0]["finish_reason"]


def openai_usage_matches(openai: dict, usage: Usage) -> None:
    """An OpenAI usage object says what the engine's ``Usage`` says (details may be absent)."""
    assert openai["prompt_tokens"] == usage.prompt_tokens
    assert openai["completion_tokens"] == usage.completion_tokens
    assert openai["total_tokens"] == usage.total_tokens
    details = openai.get("prompt_tokens_details") or {}
    assert (details.get("cached_tokens") or 0) == usage.cached_tokens


async def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, poll_interval_s: float = 0.0
) -> None:
    """Poll ``predicate`` until it holds; fail after ``timeout_s`` (0: it must hold now).
    ``poll_interval_s`` 0 polls again after one event-loop turn."""
    await eventually_async(
        predicate,
        timeout_s=timeout_s,
        what=what,
        interval_s=poll_interval_s,
    )


def idle(engine: Engine) -> Callable[[], bool]:
    def check() -> bool:
        stats = engine.stats()
        return stats.num_requests_running == 0 and stats.num_requests_waiting == 0

    return check


class EngineContract:
    """The tests every ``Engine`` passes. Subclasses provide ``engine`` and ``spec``."""

    @pytest.fixture
    def engine(self) -> Engine:
        raise NotImplementedError("a contract run provides the started engine under test")

    @pytest.fixture
    def spec(self) -> EngineSpec:
        raise NotImplementedError("a contract run provides the engine's EngineSpec")

    async def settled(self, spec: EngineSpec, predicate: Callable[[], bool], what: str) -> None:
        await wait_until(predicate, spec.settle_s, what, spec.poll_interval_s)

    # -- streaming -----------------------------------------------------------------------------

    async def test_chat_stream_is_one_completion_in_chunks(self, engine, spec):
        chunks, usage = await collect(engine, request_body(spec, "chat", stream=True), "chat")

        assert usage.completion_tokens == SHORT
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert {c["model"] for c in chunks} == {spec.model}
        (chunk_id,) = {c["id"] for c in chunks}
        assert chunk_id.startswith("chatcmpl-") and "req" in chunk_id
        assert all(isinstance(c["created"], int) for c in chunks)

    async def test_chat_stream_role_first_then_content_then_one_finish(self, engine, spec):
        chunks, usage = await collect(engine, request_body(spec, "chat", stream=True), "chat")

        choices = [c["choices"][0] for c in chunks]
        # The role chunk, then one chunk per token (an engine may merge tokens that arrive
        # together, and may carry the finish reason on the last token or on its own chunk).
        assert 2 <= len(choices) <= usage.completion_tokens + 2
        assert choices[0]["delta"]["role"] == "assistant"
        assert choices[0]["delta"].get("content") == ""
        assert choices[0]["finish_reason"] is None
        for choice in choices[1:]:
            assert choice["index"] == 0
            assert "role" not in choice["delta"]
            assert isinstance(choice["delta"].get("content", ""), str)
        assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1]["finish_reason"] == "length"

    async def test_completion_stream_is_text_chunks_then_one_finish(self, engine, spec):
        body = request_body(spec, "completion", stream=True)
        chunks, usage = await collect(engine, body, "completion")

        assert usage.completion_tokens == SHORT
        assert {c["object"] for c in chunks} == {"text_completion"}
        assert {c["model"] for c in chunks} == {spec.model}
        (chunk_id,) = {c["id"] for c in chunks}
        assert chunk_id.startswith("cmpl-") and "req" in chunk_id
        choices = [c["choices"][0] for c in chunks]
        assert 1 <= len(choices) <= usage.completion_tokens + 1
        for choice in choices:
            assert isinstance(choice["text"], str) and "delta" not in choice
        assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1]["finish_reason"] == "length"

    @pytest.mark.parametrize("kind", KINDS)
    async def test_usage_frame_last_when_the_client_asks(self, engine, spec, kind):
        body = request_body(spec, kind, stream=True, stream_options={"include_usage": True})
        chunks, usage = await collect(engine, body, kind)

        *token_chunks, usage_chunk = chunks
        assert usage_chunk["choices"] == []
        openai_usage_matches(usage_chunk["usage"], usage)
        assert usage_chunk["id"] == token_chunks[0]["id"]
        assert usage_chunk["model"] == spec.model
        for chunk in token_chunks:
            assert chunk["choices"] and chunk.get("usage") is None
        assert usage.completion_tokens == SHORT

    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize(
        "stream_options", [None, {"include_usage": False}], ids=["no-options", "false"]
    )
    async def test_no_usage_frame_unless_asked_but_usage_always_yielded(
        self, engine, spec, kind, stream_options
    ):
        extra = {} if stream_options is None else {"stream_options": stream_options}
        chunks, usage = await collect(engine, request_body(spec, kind, stream=True, **extra), kind)

        assert all(c["choices"] for c in chunks)
        assert all(c.get("usage") is None for c in chunks)
        assert usage.completion_tokens == SHORT  # still reported to the replica, for metering

    # -- non-streaming -------------------------------------------------------------------------

    @pytest.mark.parametrize(
        ("kind", "prefix", "obj"),
        [("chat", "chatcmpl-", "chat.completion"), ("completion", "cmpl-", "text_completion")],
    )
    async def test_complete_is_an_openai_response(self, engine, spec, kind, prefix, obj):
        body = request_body(spec, kind, stream=False)
        response, usage = await engine.complete(body, kind, "req-complete")

        assert response["id"].startswith(prefix) and "req-complete" in response["id"]
        assert response["object"] == obj
        assert isinstance(response["created"], int)
        assert response["model"] == spec.model
        (choice,) = response["choices"]
        assert choice["index"] == 0
        if kind == "chat":
            assert choice["message"]["role"] == "assistant"
            assert isinstance(choice["message"]["content"], str)
        else:
            assert isinstance(choice["text"], str)
        assert choice["finish_reason"] == "length"
        assert usage.completion_tokens == SHORT
        openai_usage_matches(response["usage"], usage)

    # -- usage and token limits ----------------------------------------------------------------

    @pytest.mark.parametrize("streamed", [True, False], ids=["stream", "complete"])
    @pytest.mark.parametrize("kind", KINDS)
    async def test_prompt_tokens_are_the_engines_own_count(self, engine, spec, kind, streamed):
        body = request_body(spec, kind, stream=streamed)
        usage, _ = await run_once(engine, body, kind, "req-count", streamed)
        assert usage.prompt_tokens == spec.count_prompt_tokens(body, kind)

    async def test_count_prompt_is_the_prompt_a_chat_request_is_charged(self, engine, spec):
        """What ``truncation: "auto"`` fits a conversation by (``engines/truncation.py``)."""
        assert engine.context_window == spec.max_model_len
        assert engine.default_max_tokens == spec.default_max_tokens
        body = request_body(spec, "chat", stream=False)
        body["messages"] = [
            {"role": "system", "content": "Be brief."},
            *body["messages"],
            {"role": "assistant", "content": "One moment."},
            {"role": "user", "content": "And the other one?"},
        ]
        usage, _ = await run_once(engine, body, "chat", "req-counted", streamed=False)
        assert await engine.count_prompt(body) == usage.prompt_tokens

    async def test_a_conversation_too_long_is_served_once_fitted_to_the_window(self, engine, spec):
        words = " ".join(["word"] * (spec.max_model_len // 6))
        turns = [
            {"role": role, "content": f"{role} {n}: {words}"}
            for n in range(8)
            for role in ("user", "assistant")
        ]
        body = request_body(spec, "chat", stream=True, max_tokens=4)
        body["messages"] = [*turns, {"role": "user", "content": "So?"}]
        assert await engine.count_prompt(body) > spec.max_model_len  # refused as it is
        fitted = await fit_conversation(
            {**body, TRUNCATE_KEY: "auto"},
            engine.context_window,
            engine.default_max_tokens,
            engine.count_prompt,
        )
        usage, _ = await run_once(engine, fitted, "chat", "req-fitted", streamed=True)
        assert usage.prompt_tokens <= spec.max_model_len - 4
        assert fitted["messages"][-1] == {"role": "user", "content": "So?"}

    @pytest.mark.parametrize("kind", KINDS)
    async def test_stream_and_complete_count_the_same(self, engine, spec, kind):
        body = request_body(spec, kind, stream=False)
        streamed, _ = await run_once(engine, body, kind, "req-a", streamed=True)
        completed, _ = await run_once(engine, body, kind, "req-b", streamed=False)
        assert streamed.prompt_tokens == completed.prompt_tokens
        assert streamed.completion_tokens == completed.completion_tokens == SHORT

    @pytest.mark.parametrize("streamed", [True, False], ids=["stream", "complete"])
    @pytest.mark.parametrize("kind", KINDS)
    async def test_a_natural_stop_stays_within_max_tokens(self, engine, spec, kind, streamed):
        body = request_body(spec, kind, stream=streamed, ignore_eos=False)
        usage, finish_reason = await run_once(engine, body, kind, "req-natural", streamed)

        assert finish_reason in ("stop", "length")
        assert 1 <= usage.completion_tokens <= SHORT
        if finish_reason == "length":
            assert usage.completion_tokens == SHORT

    @pytest.mark.parametrize("streamed", [True, False], ids=["stream", "complete"])
    async def test_max_completion_tokens_wins_over_max_tokens(self, engine, spec, streamed):
        body = request_body(spec, "chat", stream=streamed, max_tokens=6, max_completion_tokens=2)
        usage, finish_reason = await run_once(engine, body, "chat", "req-mct", streamed)
        assert (usage.completion_tokens, finish_reason) == (2, "length")

    @pytest.mark.parametrize("streamed", [True, False], ids=["stream", "complete"])
    @pytest.mark.parametrize("kind", KINDS)
    async def test_without_max_tokens_the_pools_default_applies(self, engine, spec, kind, streamed):
        body = request_body(spec, kind, stream=streamed, max_tokens=None)
        usage, finish_reason = await run_once(engine, body, kind, "req-default", streamed)
        assert (usage.completion_tokens, finish_reason) == (spec.default_max_tokens, "length")

    async def test_a_repeated_client_request_id_is_served_twice_at_once(self, engine, spec):
        body = request_body(spec, "chat", stream=True)
        (a, usage_a), (b, usage_b) = await asyncio.gather(
            collect(engine, body, "chat", "dup"), collect(engine, body, "chat", "dup")
        )
        assert usage_a.completion_tokens == usage_b.completion_tokens == SHORT
        assert (
            a[-1]["choices"][0]["finish_reason"] == b[-1]["choices"][0]["finish_reason"] == "length"
        )
        assert "dup" in a[0]["id"] and "dup" in b[0]["id"]

    # -- errors --------------------------------------------------------------------------------

    @pytest.mark.parametrize("streamed", [True, False], ids=["stream", "complete"])
    @pytest.mark.parametrize("kind", KINDS)
    async def test_a_prompt_past_the_context_is_a_400(self, engine, spec, kind, streamed):
        words = "word " * (spec.max_model_len + 100)  # at least one token per word, anywhere
        extra = {"messages": [{"role": "user", "content": words}]} if kind == "chat" else {}
        extra |= {"prompt": words} if kind == "completion" else {}
        body = request_body(spec, kind, stream=streamed, max_tokens=4, **extra)

        with pytest.raises(ForgeError) as caught:
            if streamed:
                await collect(engine, body, kind, "req-too-long")
            else:
                await engine.complete(body, kind, "req-too-long")
        assert (caught.value.status, caught.value.code) == (400, "context_length_exceeded")
        await self.settled(spec, idle(engine), "nothing running after a rejected request")

    async def test_max_tokens_past_what_the_context_has_left_is_cut_to_it(self, engine, spec):
        """vLLM caps a request's ``max_tokens`` at what the context has left after its prompt:
        an agent that asks for a long answer (Claude Code asks for 32,000 tokens) on a smaller
        model is answered to the context's end, not refused."""
        body = request_body(spec, "chat", stream=True, max_tokens=spec.max_model_len)
        left = spec.max_model_len - spec.count_prompt_tokens(body, "chat")
        frames, usage = await collect(engine, body, "chat", "req-past-the-context")
        assert usage.completion_tokens == left
        assert frames[-1]["choices"] == [] or frames[-1]["choices"][0]["finish_reason"]
        finishes = [c["finish_reason"] for f in frames for c in f["choices"] if c["finish_reason"]]
        assert finishes == ["length"]

    async def test_max_tokens_past_the_whole_context_is_a_400_naming_it(self, engine, spec):
        body = request_body(spec, "chat", stream=False, max_tokens=spec.max_model_len + 1)
        with pytest.raises(ForgeError) as caught:
            await engine.complete(body, "chat", "req-past-the-window")
        assert caught.value.status == 400 and "max_tokens" in caught.value.message
        await self.settled(spec, idle(engine), "nothing running after a rejected request")

    @pytest.mark.parametrize("streamed", [True, False], ids=["stream", "complete"])
    async def test_a_malformed_request_is_a_400_naming_the_field(self, engine, spec, streamed):
        body = {"model": spec.model, "messages": "not a list", "stream": streamed}

        with pytest.raises(ForgeError) as caught:
            if streamed:
                await collect(engine, body, "chat", "req-bad")
            else:
                await engine.complete(body, "chat", "req-bad")
        assert caught.value.status == 400
        assert "messages" in caught.value.message

    # -- slots, abort and stats ----------------------------------------------------------------

    @pytest.mark.parametrize(
        ("fields", "named"),
        [
            ({"tools": "x"}, "tools"),
            ({"tools": True}, "tools"),
            ({"tools": []}, "tools"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
            ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "function"),
            ({"tools": [TOOL], "tool_choice": _named("other")}, "tool_choice"),
            ({"response_format": {"type": "xml"}}, "response_format"),
            ({"stop": 5}, "stop"),
            ({"top_logprobs": 2}, "top_logprobs"),
            ({"reasoning_effort": "ultra"}, "reasoning_effort"),
        ],
    )
    async def test_what_vllm_refuses_is_a_400_naming_the_field(self, engine, spec, fields, named):
        """The simulator refuses what vLLM's serving layer refuses: a mistake shows on the
        laptop, not first on the cluster."""
        body = request_body(spec, "chat", stream=False, **fields)
        with pytest.raises(ForgeError) as caught:
            await engine.complete(body, "chat", "req-refused")
        assert caught.value.status == 400
        assert named in f"{caught.value.param} {caught.value.message}"
        ok = request_body(spec, "chat", stream=False, tools=[TOOL], tool_choice=_named("f"))
        await engine.complete(ok, "chat", "req-named")  # the same fields, right, are served

    @pytest.mark.parametrize("streamed", [True, False], ids=["stream", "complete"])
    async def test_chat_logprobs_describe_each_token_in_vllms_shape(self, engine, spec, streamed):
        body = request_body(spec, "chat", stream=streamed, logprobs=True, top_logprobs=2)
        if streamed:
            chunks, usage = await collect(engine, body, "chat", "req-lp")
            content = [
                entry
                for c in chunks
                for choice in c["choices"]
                if choice.get("logprobs")
                for entry in choice["logprobs"]["content"]
            ]
        else:
            response, usage = await engine.complete(body, "chat", "req-lp")
            content = response["choices"][0]["logprobs"]["content"]
        assert len(content) == usage.completion_tokens == SHORT
        for entry in content:
            assert isinstance(entry["token"], str) and entry["logprob"] <= 0
            assert isinstance(entry["bytes"], list)
            assert len(entry["top_logprobs"]) == 2
            assert entry["top_logprobs"][0]["token"] == entry["token"]  # the sampled one first
            assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]

    @pytest.mark.parametrize("streamed", [True, False], ids=["stream", "complete"])
    async def test_completion_logprobs_describe_each_token_in_vllms_shape(
        self, engine, spec, streamed
    ):
        body = request_body(spec, "completion", stream=streamed, logprobs=2)
        if streamed:
            chunks, usage = await collect(engine, body, "completion", "req-lp")
            parts = [
                choice["logprobs"] for c in chunks for choice in c["choices"] if choice["logprobs"]
            ]
            tokens = [t for p in parts for t in p["tokens"]]
            offsets = [o for p in parts for o in p["text_offset"]]
            values = [v for p in parts for v in p["token_logprobs"]]
            tops = [t for p in parts for t in p["top_logprobs"]]
        else:
            response, usage = await engine.complete(body, "completion", "req-lp")
            said = response["choices"][0]["logprobs"]
            tokens, offsets = said["tokens"], said["text_offset"]
            values, tops = said["token_logprobs"], said["top_logprobs"]
        assert len(tokens) == len(offsets) == len(values) == len(tops) == usage.completion_tokens
        assert offsets == sorted(offsets)  # running on across chunks
        assert all(v <= 0 for v in values)
        for token, top in zip(tokens, tops, strict=True):
            # k alternatives and the token, keyed by their text: two tokens that decode alike
            # (a random model's stray bytes, each "\ufffd") are one key, as in vLLM's own.
            assert token in top and 1 <= len(top) <= 3

    @pytest.mark.parametrize("kind", KINDS)
    async def test_no_logprobs_unless_asked(self, engine, spec, kind):
        response, _ = await engine.complete(request_body(spec, kind, stream=False), kind, "r")
        assert response["choices"][0]["logprobs"] is None

    async def test_more_logprobs_than_vllm_gives_is_a_400(self, engine, spec):
        body = request_body(spec, "chat", stream=False, logprobs=True, top_logprobs=21)
        with pytest.raises(ForgeError) as caught:
            await engine.complete(body, "chat", "req-lp-many")
        assert caught.value.status == 400
        assert "max allowed: 20" in caught.value.message

    @pytest.mark.parametrize("tools", [True, 5, {"type": "function"}])
    async def test_malformed_tools_are_a_400_streamed_too(self, engine, spec, tools):
        """Not a replica's 5xx: that counts against the pool's breaker, for every tenant."""
        body = request_body(spec, "chat", stream=True, tools=tools)
        with pytest.raises(ForgeError) as caught:
            await collect(engine, body, "chat", "req-bad-tools")
        assert caught.value.status == 400

    async def test_stats_are_engine_stats_and_idle_at_rest(self, engine, spec):
        await self.settled(spec, idle(engine), "idle")
        stats = engine.stats()

        assert isinstance(stats, EngineStats)
        assert set(stats.as_dict()) == {f.name for f in fields(EngineStats)}
        adapters = ("running_lora_adapters", "waiting_lora_adapters", "lora_adapters")
        counts = [
            v for k, v in stats.as_dict().items() if k not in ("kv_cache_usage_perc", *adapters)
        ]
        assert all(type(v) is int and v >= 0 for v in counts)
        assert not stats.running_lora_adapters and not stats.waiting_lora_adapters
        assert isinstance(stats.kv_cache_usage_perc, float)
        assert stats.kv_cache_usage_perc == 0.0  # evictable cached blocks count as free
        assert stats.max_num_seqs == spec.max_num_seqs
        assert stats.prefix_cache_hits <= stats.prefix_cache_queries
        assert await engine.check_health() is None

    async def test_an_open_stream_holds_a_slot_and_closing_it_frees_it(self, engine, spec):
        body = request_body(spec, "chat", stream=True, max_tokens=LONG_GENERATION)
        before = engine.stats()
        stream = engine.stream(body, "chat", "req-walks-away")
        for _ in range(3):
            await anext(stream)

        await self.settled(
            spec, lambda: engine.stats().num_requests_running == 1, "running == 1 while open"
        )
        during = engine.stats()
        assert during.num_requests_waiting == 0
        assert 0.0 < during.kv_cache_usage_perc <= 1.0
        prompt_tokens = spec.count_prompt_tokens(body, "chat")
        assert during.prefix_cache_queries - before.prefix_cache_queries == prompt_tokens

        await stream.aclose()  # what the replica does when the gateway's caller goes away

        await self.settled(spec, idle(engine), "idle once the stream is closed")
        after = engine.stats()
        assert after.kv_cache_usage_perc == 0.0
        assert after.generation_tokens - before.generation_tokens < LONG_GENERATION / 2

    async def test_cancelling_the_consumer_frees_the_slot(self, engine, spec):
        body = request_body(spec, "chat", stream=True, max_tokens=LONG_GENERATION)
        before = engine.stats().generation_tokens
        third_frame = asyncio.Event()

        async def consume() -> None:
            seen = 0
            async for _ in engine.stream(body, "chat", "req-cancel"):
                seen += 1
                if seen == 3:
                    third_frame.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(third_frame.wait(), 30)
        await self.settled(spec, lambda: engine.stats().num_requests_running == 1, "running")

        task.cancel()  # the replica cancels its producer task the same way
        with contextlib.suppress(asyncio.CancelledError):
            await task

        await self.settled(spec, idle(engine), "idle once the consumer is cancelled")
        assert engine.stats().kv_cache_usage_perc == 0.0
        assert engine.stats().generation_tokens - before < LONG_GENERATION / 2

    async def test_cancelling_complete_frees_the_slot(self, engine, spec):
        body = request_body(spec, "chat", stream=False, max_tokens=LONG_GENERATION)
        before = engine.stats().generation_tokens
        task = asyncio.create_task(engine.complete(body, "chat", "req-cancel-complete"))
        await wait_until(
            lambda: engine.stats().num_requests_running == 1,
            30,
            "running == 1",
            spec.poll_interval_s,
        )

        task.cancel()
        # What the cancelled caller sees is not part of the contract (it has gone away).
        await asyncio.gather(task, return_exceptions=True)

        await self.settled(spec, idle(engine), "idle once complete() is cancelled")
        assert engine.stats().kv_cache_usage_perc == 0.0
        assert engine.stats().generation_tokens - before < LONG_GENERATION / 2

    # -- abandoned streams (``Engine.abandoned``, collected by ``Replica.abandoned_usage``) --------

    async def test_a_closed_stream_leaves_what_it_cost_to_collect_once(self, engine, spec):
        body = request_body(spec, "chat", stream=True, max_tokens=LONG_GENERATION)
        before = engine.stats().generation_tokens
        stream = engine.stream(body, "chat", "req-abandoned")
        for _ in range(3):  # the role chunk, then at least two generated tokens
            await anext(stream)

        await stream.aclose()

        usage = await engine.abandoned.collect("req-abandoned", 5.0)
        assert usage is not None, "an aborted stream's cost is recorded, not left to estimate"
        assert usage.prompt_tokens == spec.count_prompt_tokens(body, "chat")
        assert 0 <= usage.cached_tokens <= usage.prompt_tokens
        assert 2 <= usage.completion_tokens < LONG_GENERATION / 2
        # Never more than the engine generated (vLLM's counter may have a token more: one it
        # produced but had not yet handed the stream when the abort came).
        await self.settled(
            spec,
            lambda: engine.stats().generation_tokens - before >= usage.completion_tokens,
            "the engine's counter to include what was charged",
        )
        assert await engine.abandoned.collect("req-abandoned", 0.05) is None

    async def test_a_stream_read_to_its_end_leaves_nothing_to_collect(self, engine, spec):
        body = request_body(spec, "chat", stream=True)
        _, usage = await collect(engine, body, "chat", "req-read-to-end")

        assert usage.completion_tokens == SHORT  # the replica delivers this one
        assert await engine.abandoned.collect("req-read-to-end", 0.05) is None

    async def test_requests_beyond_max_num_seqs_wait_and_cancelling_frees_all(self, engine, spec):
        body = request_body(spec, "chat", stream=True, max_tokens=LONG_GENERATION)

        async def consume(i: int) -> None:
            async for _ in engine.stream(body, "chat", f"req-slot-{i}"):
                pass

        tasks = [asyncio.create_task(consume(i)) for i in range(spec.max_num_seqs + 1)]
        try:
            await wait_until(
                lambda: (
                    (engine.stats().num_requests_running, engine.stats().num_requests_waiting)
                    == (spec.max_num_seqs, 1)
                ),
                30,
                "max_num_seqs running and one waiting",
                spec.poll_interval_s,
            )
            assert engine.stats().kv_cache_usage_perc > 0.0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        await self.settled(spec, idle(engine), "idle once every consumer is cancelled")
        assert engine.stats().kv_cache_usage_perc == 0.0

    async def test_generation_tokens_count_every_generated_token(self, engine, spec):
        before = engine.stats().generation_tokens
        _, usage = await engine.complete(request_body(spec, "chat", stream=False), "chat", "r")
        assert engine.stats().generation_tokens - before >= usage.completion_tokens == SHORT

    async def test_a_repeated_prompt_hits_the_prefix_cache(self, engine, spec):
        body = request_body(spec, "completion", stream=False, max_tokens=2, prompt=CACHED_PROMPT)
        before = engine.stats()

        first_response, first = await engine.complete(body, "completion", "req-prefix-1")
        second_response, second = await engine.complete(body, "completion", "req-prefix-2")

        after = engine.stats()
        block = spec.block_size
        assert first.prompt_tokens == second.prompt_tokens > 4 * block
        assert first.cached_tokens == 0
        # Whole blocks, all but at most the last full one (recomputed for the first logits).
        assert second.cached_tokens % block == 0
        assert (second.prompt_tokens // block - 1) * block <= second.cached_tokens
        assert second.cached_tokens < second.prompt_tokens
        openai_usage_matches(first_response["usage"], first)
        openai_usage_matches(second_response["usage"], second)
        # The cache counters count tokens, as vllm:prefix_cache_{queries,hits}_total do.
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        assert queries == first.prompt_tokens + second.prompt_tokens
        assert second.cached_tokens <= hits <= queries

    async def test_cached_block_hashes_are_ints(self, engine, spec):
        await engine.complete(request_body(spec, "completion", stream=False), "completion", "r")
        hashes = engine.cached_block_hashes()
        assert isinstance(hashes, list)
        assert all(type(h) is int for h in hashes)
