"""Tool calls through a failover to Gemini, as an agent sees them: the mock fallback streams
them as Gemini's OpenAI-compatible endpoint does (no ``index``, the first call signed) and
refuses, as Gemini 3 does, a turn whose calls carry no thought signature."""

from __future__ import annotations

import json

import openai
import pytest

from serve_app.backends.gemini_compat import PLACEHOLDER_SIGNATURE, ToolCallIndexes, signed
from serve_app.gateway.server import Gateway
from tests.dialects.conftest import ASK, STATUS_SCHEMA, openai_client
from tests.gateway import test_server
from tests.gateway.test_server import MODEL

gateway = test_server.gateway  # the gateway test's in-process gateway, as this module's fixture

STATUS = {
    "type": "function",
    "function": {"name": "get_service_status", "parameters": STATUS_SCHEMA},
}
TICKET = {
    "type": "function",
    "function": {"name": "open_ticket", "parameters": {"type": "object", "properties": {}}},
}
BOTH = [{"role": "user", "content": "Check the service status and open a ticket"}]


def fail_primary(gateway: Gateway) -> None:
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "error"})


async def test_parallel_calls_from_the_fallback_stay_apart_in_the_sdks_stream_helper(
    gateway: Gateway,
):
    """The ``openai`` SDK's stream helper refuses a tool-call delta without an index; a reader
    that takes 0 for it merges the two calls into one."""
    fail_primary(gateway)
    async with openai_client(gateway) as client:
        async with client.chat.completions.stream(
            model=MODEL, messages=BOTH, tools=[STATUS, TICKET]
        ) as stream:
            final = await stream.get_final_completion()
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=BOTH, tools=[STATUS, TICKET], stream=True
        )
        indexes = [
            call.index
            async for chunk in raw.parse()
            for choice in chunk.choices
            for call in choice.delta.tool_calls or ()
        ]
    assert raw.headers["x-forge-backend"] == "fallback"
    calls = final.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_service_status", "open_ticket"]
    assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)
    assert None not in indexes and sorted(set(indexes)) == [0, 1]


async def test_an_agent_loop_failed_over_mid_turn_goes_on(gateway: Gateway):
    """The primary (vLLM signs nothing) made the turn's call; the primary fails; the call's
    result goes to Gemini, which would refuse the unsigned call."""
    async with openai_client(gateway) as client:
        ask = [{"role": "user", "content": ASK}]
        first = await client.chat.completions.create(model=MODEL, messages=ask, tools=[STATUS])
        response = await client.responses.create(
            model=MODEL, input=ASK, tools=[{"type": "function", **STATUS["function"]}]
        )
        fail_primary(gateway)
        (call,) = first.choices[0].message.tool_calls
        result = {"role": "tool", "tool_call_id": call.id, "content": "checkout is up"}
        turn = first.choices[0].message.model_dump(exclude_none=True)
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[*ask, turn, result], tools=[STATUS]
        )
        (output,) = response.output
        follow = await client.responses.with_raw_response.create(
            model=MODEL,
            previous_response_id=response.id,
            input=[{"type": "function_call_output", "call_id": output.call_id, "output": "up"}],
        )
    assert raw.headers["x-forge-backend"] == follow.headers["x-forge-backend"] == "fallback"
    assert raw.parse().choices[0].message.content
    assert follow.parse().output_text


async def test_an_upstream_that_is_not_gemini_gets_no_signature(gateway: Gateway):
    """``fill_thought_signatures: false``: nothing is added, and the mock (Gemini) refuses the
    unsigned call: the client's 400, as the upstream said it."""
    fallback = gateway.backends["fallback"]
    fallback.config = fallback.config.model_copy(update={"fill_thought_signatures": False})
    fail_primary(gateway)
    call = {"id": "c1", "type": "function", "function": {"name": "get_service_status"}}
    call["function"]["arguments"] = "{}"
    said = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "up"},
    ]
    async with openai_client(gateway) as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, messages=said, tools=[STATUS])
    assert "thought_signature" in refused.value.message


def test_only_the_current_turns_unsigned_steps_are_signed():
    def step(*ids: str, signature: str | None = None) -> dict:
        calls = [{"id": i, "type": "function", "function": {"name": "f"}} for i in ids]
        if signature:
            calls[0]["extra_content"] = {"google": {"thought_signature": signature}}
        return {"role": "assistant", "content": None, "tool_calls": calls}

    earlier = step("a")
    messages = [
        {"role": "user", "content": "one"},
        earlier,
        {"role": "user", "content": "two"},
        step("b", "c"),
        {"role": "tool", "tool_call_id": "b", "content": "x"},
        step("d", signature="gemini's own"),
    ]
    out = signed(messages)
    signatures = [
        [
            (c.get("extra_content") or {}).get("google", {}).get("thought_signature")
            for c in m["tool_calls"]
        ]
        for m in out
        if m.get("tool_calls")
    ]
    assert signatures == [[None], [PLACEHOLDER_SIGNATURE, None], ["gemini's own"]]
    assert out[1] is earlier and "extra_content" not in messages[3]["tool_calls"][0]


def test_indexes_follow_the_calls_ids_and_keep_those_given():
    def event(*parts: dict) -> bytes:
        chunk = {"choices": [{"index": 0, "delta": {"tool_calls": list(parts)}}]}
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    def indexes_of(events: list[bytes]) -> list[int]:
        return [
            part["index"]
            for e in events
            for part in json.loads(e[6:])["choices"][0]["delta"]["tool_calls"]
        ]

    mended = ToolCallIndexes()
    unindexed = [
        event({"id": "a", "function": {"name": "f", "arguments": "{"}}),
        event({"function": {"arguments": "}"}}),
        event({"id": "b", "function": {"name": "g", "arguments": "{}"}}),
        event({"id": "b", "function": {"arguments": ""}}),
    ]
    assert indexes_of([mended.mend(e) for e in unindexed]) == [0, 0, 1, 1]
    given = event({"index": 3, "id": "x", "function": {"name": "f", "arguments": ""}})
    assert ToolCallIndexes().mend(given) is given  # untouched, not re-encoded
    plain = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    assert ToolCallIndexes().mend(plain) is plain


def test_a_stored_conversation_keeps_geminis_own_signature():
    """The Responses route's history (``assistant_turn`` over the streamed calls) sends
    Gemini's signature back with its call, not the placeholder."""
    from serve_app.dialects.base import ToolCallDeltas, assistant_turn

    calls = ToolCallDeltas()
    signature = {"google": {"thought_signature": "gemini's own"}}
    part = {"index": 0, "id": "c1", "function": {"name": "f", "arguments": "{}"}}
    calls.feed({"tool_calls": [{**part, "extra_content": signature}]})
    (kept,) = assistant_turn("", calls.all())["tool_calls"]
    assert kept["extra_content"] == signature
    assert signed([{"role": "user", "content": "x"}, assistant_turn("", calls.all())])[1] == (
        assistant_turn("", calls.all())
    )
