"""``stop`` and ``response_format`` in the simulated engine, as a client sees them."""

from __future__ import annotations

import json

import orjson
import pytest

from serve_app.config.models import SimulatedEngineConfig
from serve_app.engines.output_rules import StopMatcher
from serve_app.engines.simulated import SimulatedEngine

BODY = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 40}


@pytest.fixture
async def engine():
    engine = SimulatedEngine("m", SimulatedEngineConfig(prefill_base_s=0, decode_base_s=0), 64)
    yield engine
    await engine.shutdown()


async def answer(engine: SimulatedEngine, body: dict, request_id: str) -> tuple[str, str, int]:
    response, usage = await engine.complete(body, "chat", request_id)
    choice = response["choices"][0]
    return choice["message"]["content"], choice["finish_reason"], usage.completion_tokens


async def streamed(engine: SimulatedEngine, body: dict, request_id: str) -> tuple[str, str, int]:
    text, reason, usage = "", None, None
    async for frame in engine.stream(
        body | {"stream_options": {"include_usage": True}}, "chat", request_id
    ):
        if not isinstance(frame, bytes):
            continue
        chunk = orjson.loads(frame[len(b"data: ") :])
        if chunk["choices"]:
            text += chunk["choices"][0]["delta"].get("content") or ""
            reason = chunk["choices"][0]["finish_reason"] or reason
        else:
            usage = chunk["usage"]
    return text, reason, usage["completion_tokens"]


async def test_a_stop_string_ends_the_answer_before_it_streamed_or_not(engine):
    plain, _, plain_tokens = await answer(engine, BODY, "plain")
    stop = plain.split(" ")[5]  # a word the model will say, mid-answer
    cut = plain[: plain.index(" " + stop)]
    for get in (answer, streamed):
        text, reason, tokens = await get(engine, BODY | {"stop": ["zzz", " " + stop]}, "s")
        assert (text, reason) == (cut, "stop")
        assert tokens < plain_tokens  # generation stopped there, as vLLM's does
    assert not engine.abandoned._entries  # a stop is a finish, not an abandoned stream


async def final_choice(engine: SimulatedEngine, body: dict, request_id: str, stream: bool):
    """The answer's last choice: the whole one, or the stream's chunk with its finish reason."""
    if not stream:
        response, _ = await engine.complete(body, "chat", request_id)
        return response["choices"][0]
    frames = [f async for f in engine.stream(body, "chat", request_id) if isinstance(f, bytes)]
    chunks = [orjson.loads(f[len(b"data: ") :]) for f in frames]
    (last,) = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    return last


@pytest.mark.parametrize("stream", [False, True])
async def test_the_stop_string_that_ended_it_is_its_stop_reason_as_vllm_says(engine, stream):
    plain, _, _ = await answer(engine, BODY, "plain")
    stop = " " + plain.split(" ")[5]
    stopped = await final_choice(engine, BODY | {"stop": ["zzz", stop]}, "s", stream)
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)
    ended = await final_choice(engine, BODY | {"stop": ["zzz"]}, "e", stream)
    assert ended["stop_reason"] is None  # vLLM's null: it ended otherwise
    # The engine behind the mock fallback plays an OpenAI-compatible API: no such field.
    engine.stop_reason = False
    assert "stop_reason" not in await final_choice(engine, BODY | {"stop": stop}, "m", stream)


async def test_a_stop_string_never_said_changes_nothing(engine):
    plain = await answer(engine, BODY, "a")
    assert await answer(engine, BODY | {"stop": "never-said"}, "b") == plain


def test_text_that_may_start_a_stop_string_is_held_back_across_tokens():
    matcher = StopMatcher(["END!"])
    assert matcher.feed("one EN") == ("one ", False)
    assert matcher.feed("D") == ("", False)
    assert matcher.feed("!more") == ("", True)
    assert matcher.matched == "END!"
    first = StopMatcher(["later", "now"])  # the one that comes first in the text ended it
    assert first.feed("stop now, not later") == ("stop ", True) and first.matched == "now"
    other = StopMatcher(["END!"])
    assert other.feed("one EN") == ("one ", False)
    assert other.feed("d") == ("ENd", False)
    assert other.flush() == ""


@pytest.mark.parametrize("get", [answer, streamed])
async def test_json_object_mode_answers_one_json_object(engine, get):
    text, reason, _ = await get(engine, BODY | {"response_format": {"type": "json_object"}}, "j")
    assert reason == "stop"
    assert isinstance(json.loads(text)["answer"], str)


async def test_json_schema_mode_fills_every_top_level_property_by_type(engine):
    schema = {
        "type": "object",
        "properties": {
            "count": {"type": "integer"},
            "summary": {"type": "string"},
            "ok": {"type": "boolean"},
            "level": {"enum": ["low", "high"]},
        },
        "required": ["count", "summary", "ok", "level"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": schema}}
    text, _, _ = await answer(engine, BODY | {"response_format": fmt}, "js")
    data = json.loads(text)
    assert list(data) == ["count", "summary", "ok", "level"]
    assert (data["count"], data["ok"], data["level"]) == (0, False, "low")
    assert data["summary"].strip()


async def test_json_cut_by_max_tokens_is_unfinished_as_a_real_models_is(engine):
    body = BODY | {"max_tokens": 2, "response_format": {"type": "json_object"}}
    text, reason, _ = await answer(engine, body, "cut")
    assert reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
