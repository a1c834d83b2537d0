"""``truncation: "auto"``: which turns a conversation too long for its window keeps, as the
replica fits it with its engine's own count (``serve_app/engines/truncation.py``)."""

from __future__ import annotations

import pytest

from serve_app import protocol, tokenizer
from serve_app.engines.truncation import TRUNCATE_KEY, fit_conversation

WORDS = " ".join(f"w{i}" for i in range(40))  # 40 tokens, and the template's


async def count(body: dict) -> int:
    return tokenizer.count_tokens(protocol.prompt_text(body, "chat"))


def turn(n: int, *, tool: bool = False) -> list[dict]:
    said = [{"role": "user", "content": f"question {n} {WORDS}"}]
    if tool:
        call = {"id": f"c{n}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        said += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{n}", "content": WORDS},
        ]
    return [*said, {"role": "assistant", "content": f"answer {n} {WORDS}"}]


def conversation(turns: int, **kind) -> list[dict]:
    history = [m for n in range(turns) for m in turn(n, **kind)]
    return [{"role": "system", "content": "Be brief."}, *history, *turn(turns)[:1]]


@pytest.mark.parametrize("tool", [False, True])
async def test_the_oldest_whole_turns_go_until_the_rest_fits(tool):
    body = {"model": "m", "messages": conversation(10, tool=tool), TRUNCATE_KEY: "auto"}
    fitted = await fit_conversation(body, 600, 100, count)
    kept = fitted["messages"]
    assert TRUNCATE_KEY not in fitted
    assert kept[0] == {"role": "system", "content": "Be brief."}
    assert kept[1]["role"] == "user" and kept[-1] == body["messages"][-1]
    assert kept[1:] == body["messages"][-len(kept) + 1 :]  # the latest turns, whole
    assert await count(fitted) <= 600 - 100
    # One turn more would not have fitted: as few dropped as the room allows.
    first = body["messages"].index(kept[1])
    previous = body["messages"][first - len(turn(0, tool=tool)) : first]
    assert await count({**fitted, "messages": [kept[0], *previous, *kept[1:]]}) > 600 - 100


async def test_a_conversation_that_fits_or_did_not_ask_is_left_whole():
    body = {"model": "m", "messages": conversation(2), TRUNCATE_KEY: "auto"}
    assert (await fit_conversation(body, 10_000, 100, count))["messages"] == body["messages"]
    plain = {"model": "m", "messages": conversation(10)}
    assert await fit_conversation(plain, 200, 100, count) == plain


async def test_room_for_the_answer_is_its_max_tokens_at_most_half_the_window():
    body = {"model": "m", "messages": conversation(10), TRUNCATE_KEY: "auto"}
    asked = await fit_conversation({**body, "max_tokens": 300}, 800, 16, count)
    assert await count(asked) <= 500
    greedy = await fit_conversation({**body, "max_tokens": 10_000}, 800, 16, count)
    assert 0 < await count(greedy) <= 400


async def test_a_last_turn_too_long_alone_is_left_for_the_engine_to_refuse():
    body = {"model": "m", "messages": conversation(3), TRUNCATE_KEY: "auto"}
    fitted = await fit_conversation(body, 60, 10, count)
    assert fitted["messages"] == [body["messages"][0], body["messages"][-1]]
