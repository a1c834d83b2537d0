"""The response cache's rules (``stages/cache_rules.py``): which requests may be cached, under
which key, and how a stored answer is rebuilt from a real stream and rendered again."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest

from serve_app import sse
from serve_app.config.models import PoolConfig, SimulatedEngineConfig
from serve_app.engines.base import Usage
from serve_app.engines.simulated import SimulatedEngine
from serve_app.stages.cache_rules import CachedAnswer, bypass_reason, cache_key

MODEL = "forge-sim"
FAST = {"prefill_base_s": 0.0, "decode_base_s": 0.0, "output_tokens_min": 4, "output_tokens_max": 8}
MESSAGES = [{"role": "user", "content": "Hello, Forge"}]
USAGE = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "temperature": 0, **extra}


def key(body: dict, *, scope="tenant:alpha", model=MODEL, engine="sim:v1", route="chat") -> str:
    return cache_key(scope, model, engine, route, body)


# -- what may be cached ----------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0, 0.0])
def test_temperature_zero_is_cacheable(temperature):
    assert bypass_reason(chat(temperature=temperature), None) is None


def test_absent_temperature_is_not_cacheable_it_means_one():
    body = chat()
    del body["temperature"]
    assert bypass_reason(body, None) == "sampling"


@pytest.mark.parametrize("temperature", [0.7, 1, 2.0, False, None])
def test_a_temperature_other_than_zero_is_not_cacheable(temperature):
    assert bypass_reason(chat(temperature=temperature), None) == "sampling"


@pytest.mark.parametrize("n", [2, 5])
def test_more_than_one_choice_is_not_cacheable(n):
    assert bypass_reason(chat(n=n), None) == "sampling"


def test_one_choice_asked_for_explicitly_is_cacheable():
    assert bypass_reason(chat(n=1), None) is None


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"tools": TOOLS}, "tools"),
        ({"tool_choice": "auto"}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
        ({"functions": [{"name": "f"}]}, "tools"),
        ({"function_call": "auto"}, "tools"),
        ({"logprobs": True}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 3}, "logprobs"),
        ({"logprobs": 0}, "logprobs"),  # /v1/completions: the chosen token's log probability
    ],
)
def test_tools_and_logprobs_are_not_cacheable(extra, reason):
    assert bypass_reason(chat(**extra), None) == reason


@pytest.mark.parametrize(
    "extra", [{"tools": []}, {"tools": None}, {"logprobs": False}, {"logprobs": None}]
)
def test_tools_and_logprobs_switched_off_explicitly_stay_cacheable(extra):
    assert bypass_reason(chat(**extra), None) is None


@pytest.mark.parametrize(
    "cache_control",
    [
        "no-cache",
        "no-store",
        "No-Cache",
        "NO-STORE",
        "  no-cache  ",
        "max-age=0, no-cache",
        "max-age=0,no-store",
        "private ,  No-Store ",
    ],
)
def test_the_clients_no_cache_or_no_store_bypasses(cache_control):
    assert bypass_reason(chat(), cache_control) == "client"


@pytest.mark.parametrize("cache_control", [None, "", "max-age=60", "public", "no-transform"])
def test_other_cache_control_directives_do_not_bypass(cache_control):
    assert bypass_reason(chat(), cache_control) is None


def test_the_clients_no_cache_wins_over_any_other_reason():
    assert bypass_reason(chat(temperature=0.7), "no-cache") == "client"


# -- the key ---------------------------------------------------------------------------------


def test_the_same_request_has_the_same_key_whatever_the_order_of_its_fields():
    body = chat(max_tokens=5, seed=1)
    assert key(body) == key(dict(reversed(list(body.items()))))
    assert key(body).startswith("cache:")


def test_the_seed_is_part_of_the_key():
    assert key(chat(seed=1)) != key(chat(seed=2)) != key(chat())
    assert key(chat(seed=1)) != key(chat())


@pytest.mark.parametrize(
    "extra",
    [
        {"stream": True},
        {"stream": False},
        {"stream": True, "stream_options": {"include_usage": True}},
        {"user": "someone@example.com"},
    ],
)
def test_fields_that_cannot_change_the_answer_do_not_change_the_key(extra):
    assert key(chat(**extra)) == key(chat())


@pytest.mark.parametrize(
    "change",
    [
        {"scope": "tenant:beta"},
        {"scope": "shared"},
        {"model": "other-model"},
        {"engine": "sim:v2"},
        {"route": "completion"},
    ],
)
def test_another_scope_model_engine_or_route_is_another_key(change):
    assert key(chat(), **change) != key(chat())


@pytest.mark.parametrize(
    "extra",
    [
        {"max_tokens": 5},
        {"top_p": 0.5},
        {"stop": ["\n"]},
        {"messages": [{"role": "user", "content": "Hello, Forge!"}]},
        {"a_sampling_parameter_from_the_future": 0.3},
        {"ignore_eos": True},
    ],
)
def test_any_other_field_known_or_not_changes_the_key(extra):
    assert key(chat(**extra)) != key(chat())


def test_the_pools_engine_identity_tells_engines_apart():
    a = PoolConfig(model=MODEL, engine=FAST)
    b = PoolConfig(model=MODEL, engine={**FAST, "output_tokens_max": 9})
    assert a.engine_identity() == PoolConfig(model=MODEL, engine=FAST).engine_identity()
    assert key(chat(), engine=a.engine_identity()) != key(chat(), engine=b.engine_identity())


# -- from a real engine's answer -------------------------------------------------------------


@pytest.fixture
async def engine() -> AsyncIterator[SimulatedEngine]:
    engine = SimulatedEngine(MODEL, SimulatedEngineConfig(**FAST), default_max_tokens=256)
    yield engine
    await engine.shutdown()


async def streamed(engine: SimulatedEngine, body: dict, kind: str) -> tuple[list[bytes], dict]:
    frames, usage = [], None
    async for item in engine.stream(body, kind, "req-stream"):
        if isinstance(item, Usage):
            usage = item.to_openai()
        else:
            frames.append(item)
    return [*frames, sse.DONE], usage


@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_real_chat_streams_frames_rebuild_the_non_streamed_answer(engine, include_usage):
    body = chat(max_tokens=6)
    response, _ = await engine.complete(body, "chat", "req-complete")
    from_json = CachedAnswer.from_response("chat", response)
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    frames, usage = await streamed(engine, {**body, "stream": True, **options}, "chat")
    from_stream = CachedAnswer.from_frames("chat", MODEL, frames, usage)
    assert from_json is not None and from_stream is not None
    assert from_json.text and from_stream.text == from_json.text
    assert from_stream.finish_reason == from_json.finish_reason
    assert from_stream.usage == from_json.usage == response["usage"]
    assert from_json.text == response["choices"][0]["message"]["content"]


async def test_a_real_completion_streams_frames_rebuild_the_non_streamed_answer(engine):
    body = {"model": MODEL, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 6}
    response, _ = await engine.complete(body, "completion", "req-complete")
    from_json = CachedAnswer.from_response("completion", response)
    frames, usage = await streamed(engine, {**body, "stream": True}, "completion")
    from_stream = CachedAnswer.from_frames("completion", MODEL, frames, usage)
    assert from_json is not None and from_stream is not None
    assert from_json.text == response["choices"][0]["text"] == from_stream.text
    assert from_stream.finish_reason == from_json.finish_reason


def test_a_stream_without_a_finish_or_without_usage_is_not_kept():
    frames = [
        sse.frame({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}),
        sse.frame({"choices": [{"index": 0, "delta": {"content": "lo"}}]}),
    ]
    assert CachedAnswer.from_frames("chat", MODEL, frames, USAGE) is None  # cut short
    finished = [
        *frames,
        sse.frame({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    ]
    assert CachedAnswer.from_frames("chat", MODEL, finished, None) is None
    answer = CachedAnswer.from_frames("chat", MODEL, [*finished, sse.DONE], USAGE)
    assert answer == CachedAnswer("chat", MODEL, "Hello", "stop", USAGE)


def test_vllms_stop_reason_is_kept_so_a_hit_reads_as_the_miss_did():
    ended = {"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": " friend"}
    frames = [sse.frame({"choices": [{"index": 0, "delta": {"content": "Hello"}}]})]
    streamed = CachedAnswer.from_frames(
        "chat", MODEL, [*frames, sse.frame({"choices": [ended]})], USAGE
    )
    response = {
        "choices": [
            {
                "index": 0,
                "message": {"content": "Hello"},
                "finish_reason": "stop",
                "stop_reason": " friend",
            }
        ],
        "usage": USAGE,
    }
    whole = CachedAnswer.from_response("chat", response)
    for answer in (streamed, whole):
        assert answer is not None
        stored = CachedAnswer.decode(answer.encode())
        assert stored == answer and stored.stop_reason == " friend"
        assert stored.response("r")["choices"][0]["stop_reason"] == " friend"
        *chunks, _ = parse_sse(stored.frames("r", include_usage=False))
        assert chunks[-1]["choices"][0]["stop_reason"] == " friend"
        assert all("stop_reason" not in c["choices"][0] for c in chunks[:-1])
    # A backend that does not say (an OpenAI-compatible fallback): nor does its hit.
    unsaid = CachedAnswer.decode(ANSWER.encode())
    assert unsaid is not None and "stop_reason" not in unsaid.response("r")["choices"][0]
    assert all(
        "stop_reason" not in c["choices"][0] for c in parse_sse(unsaid.frames("r", False))[:-1]
    )


def test_tool_calls_are_never_kept():
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}
    frames = [
        sse.frame({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}),
        sse.frame({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    ]
    assert CachedAnswer.from_frames("chat", MODEL, frames, USAGE) is None
    response = {
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                "finish_reason": "tool_calls",
            }
        ],
        "usage": USAGE,
    }
    assert CachedAnswer.from_response("chat", response) is None


@pytest.mark.parametrize(
    "response",
    [
        {"choices": [], "usage": USAGE},  # no choice
        {  # two choices
            "choices": [
                {"message": {"content": "a"}, "finish_reason": "stop"},
                {"message": {"content": "b"}, "finish_reason": "stop"},
            ],
            "usage": USAGE,
        },
        {"choices": [{"message": {"content": "a"}, "finish_reason": "stop"}]},  # no usage
        {
            "choices": [{"message": {"content": "a"}, "finish_reason": "content_filter"}],
            "usage": USAGE,
        },
        {"choices": [{"message": {"content": None}, "finish_reason": "stop"}], "usage": USAGE},
        {"error": {"message": "boom"}},
    ],
)
def test_a_response_that_is_not_one_plain_finished_choice_is_not_kept(response):
    assert CachedAnswer.from_response("chat", response) is None


# -- rendered again --------------------------------------------------------------------------


def parse_sse(frames: list[bytes]) -> list[dict | str]:
    out: list[dict | str] = []
    for frame in frames:
        assert frame.startswith(b"data: ") and frame.endswith(b"\n\n"), frame
        data = frame[len(b"data: ") : -2]
        out.append(data.decode() if data == b"[DONE]" else orjson.loads(data))
    return out


ANSWER = CachedAnswer("chat", MODEL, "Hello there, friend.", "stop", USAGE)
COMPLETION = CachedAnswer("completion", MODEL, " a dark and stormy night", "length", USAGE)


@pytest.mark.parametrize("answer", [ANSWER, COMPLETION])
def test_frames_are_sse_chunks_whose_contents_join_to_the_text_then_done(answer):
    events = parse_sse(answer.frames("req-9", include_usage=False))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(isinstance(c, dict) for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert all(len(c["choices"]) == 1 for c in chunks)
    if answer.route == "chat":
        assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
        assert {c["id"] for c in chunks} == {"chatcmpl-req-9"}
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    else:
        assert {c["id"] for c in chunks} == {"cmpl-req-9"}
        text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == answer.text
    assert {c["model"] for c in chunks} == {MODEL}
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert finishes[-1] == answer.finish_reason and set(finishes[:-1]) == {None}


def test_frames_carry_the_usage_chunk_only_when_asked():
    events = parse_sse(ANSWER.frames("req-9", include_usage=True))
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk = events[:-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == USAGE
    assert all(c["usage"] is None for c in chunks), "as OpenAI: null usage on the other chunks"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == ANSWER.text


def test_the_frames_rebuild_the_same_answer():
    frames = ANSWER.frames("req-9", include_usage=True)
    assert CachedAnswer.from_frames("chat", MODEL, frames, USAGE) == ANSWER
    frames = COMPLETION.frames("req-9", include_usage=False)
    assert CachedAnswer.from_frames("completion", MODEL, frames, USAGE) == COMPLETION


@pytest.mark.parametrize("answer", [ANSWER, COMPLETION])
def test_the_response_is_the_openai_body_and_rebuilds_the_same_answer(answer):
    body = answer.response("req-9")
    assert body["usage"] == USAGE and body["model"] == MODEL
    assert body["choices"][0]["finish_reason"] == answer.finish_reason
    if answer.route == "chat":
        assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-req-9"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": answer.text}
    else:
        assert body["object"] == "text_completion" and body["id"] == "cmpl-req-9"
        assert body["choices"][0]["text"] == answer.text
    assert CachedAnswer.from_response(answer.route, body) == answer


# -- stored ----------------------------------------------------------------------------------


@pytest.mark.parametrize("answer", [ANSWER, COMPLETION])
def test_encode_then_decode_is_the_same_answer(answer):
    assert CachedAnswer.decode(answer.encode()) == answer


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"garbage",
        b"\xff\xfe\x00",
        b"[1, 2, 3]",
        b'"a string"',
        b"42",
        b"null",
        b"{}",
        b'{"v": 1}',  # the current version, fields missing
        ANSWER.encode()[:-5],  # truncated
    ],
)
def test_decoding_garbage_is_none(raw):
    assert CachedAnswer.decode(raw) is None


@pytest.mark.parametrize("version", [0, 1, 3, None, "2"])
def test_decoding_another_format_is_none(version):
    entry = orjson.loads(ANSWER.encode())
    entry["v"] = version
    assert CachedAnswer.decode(orjson.dumps(entry)) is None
    del entry["v"]
    assert CachedAnswer.decode(orjson.dumps(entry)) is None
