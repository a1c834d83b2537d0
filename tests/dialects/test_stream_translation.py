"""The dialects' stream translation on a chat stream the simulator never sends but vLLM and
Gemini do: text, then two tool calls in one answer."""

from __future__ import annotations

import json
from types import SimpleNamespace

from serve_app import sse
from serve_app.dialects.messages import Exchange, MessagesDialect
from serve_app.dialects.responses import ResponsesDialect, ResponsesRequest, Turn


def chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return sse.frame({"object": "chat.completion.chunk", "choices": choices, "usage": usage})


def call(index: int, name: str | None, arguments: str) -> dict:
    part = {"index": index, "function": {"arguments": arguments}}
    if name is not None:
        part |= {
            "id": f"call_{index}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
    return {"tool_calls": [part]}


FRAMES = [
    chunk({"role": "assistant", "content": "Checking"}),
    chunk({"content": " now."}),
    chunk(call(0, "get_service_status", '{"service": ')),
    chunk(call(0, None, '"checkout"}')),
    chunk(call(1, "open_ticket", "{}")),
    chunk({}, finish="tool_calls"),
    chunk(usage={"prompt_tokens": 10, "completion_tokens": 7, "total_tokens": 17}),
    sse.DONE,
]


async def frames():
    for frame in FRAMES:
        yield frame


def events(raw: list[bytes]) -> list[dict]:
    out = []
    for event in b"".join(raw).split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(json.loads(line[6:]))
    return out


class NoStore:
    async def put(self, tenant, response_id, record) -> bool:
        self.record = record
        return True


async def test_responses_close_the_text_once_and_each_call_once():
    store = NoStore()
    request = ResponsesRequest.model_validate({"model": "m", "input": "x"})
    turn = Turn("resp_1", request, {}, [{"role": "user", "content": "x"}], "t")
    seen = events([e async for e in ResponsesDialect(store)._stream(turn, frames())])
    kinds = [e["type"] for e in seen]
    assert kinds.count("response.output_text.done") == 1
    assert (
        kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3
    )
    final = seen[-1]["response"]
    assert [item["type"] for item in final["output"]] == [
        "message",
        "function_call",
        "function_call",
    ]
    assert final["output"][0]["content"][0]["text"] == "Checking now."
    assert [item["arguments"] for item in final["output"][1:]] == ['{"service": "checkout"}', "{}"]
    # Every event names the item where it sits in the output.
    for event in seen:
        if "item_id" in event:
            assert final["output"][event["output_index"]]["id"] == event["item_id"], event
    assert store.record["messages"][-1]["content"] == "Checking now."


async def test_messages_open_and_close_one_block_per_part():
    ctx = SimpleNamespace(counted_prompt=lambda: 10, request_id="r")
    seen = events(
        [e async for e in MessagesDialect()._stream(ctx, Exchange("msg_1", "m"), frames())]
    )
    kinds = [e["type"] for e in seen]
    starts = [e["content_block"]["type"] for e in seen if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use", "tool_use"]
    assert kinds.count("content_block_stop") == 3
    assert seen[-2]["delta"]["stop_reason"] == "tool_use"
    assert kinds[-1] == "message_stop"


async def stream_of(*frames: bytes):
    for frame in (*frames, sse.DONE):
        yield frame


def anthropic_message(seen: list[dict]):
    """What the ``anthropic`` SDK's stream accumulator makes of the events."""
    from anthropic.lib.streaming._messages import accumulate_event

    snapshot, buffers = None, {}
    for event in seen:
        if event["type"] != "ping":
            snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    return snapshot


async def translated(*frames: bytes) -> list[dict]:
    ctx = SimpleNamespace(counted_prompt=lambda: 10, request_id="r")
    exchange = Exchange("msg_1", "m")
    return events([e async for e in MessagesDialect()._stream(ctx, exchange, stream_of(*frames))])


async def test_messages_close_a_tool_call_before_the_text_after_it():
    seen = await translated(
        chunk(call(0, "get_service_status", '{"service": "checkout"}')),
        chunk({"content": "Asked."}),
        chunk({}, finish="tool_calls"),
    )
    opened = [e["index"] for e in seen if e["type"] == "content_block_start"]
    closed = [e["index"] for e in seen if e["type"] == "content_block_stop"]
    assert opened == closed == [0, 1]
    message = anthropic_message(seen)
    assert [b.type for b in message.content] == ["tool_use", "text"]
    assert message.content[0].input == {"service": "checkout"}


async def test_messages_call_it_tool_use_whatever_the_finish_reason_said():
    """vLLM finishes a named tool's call with ``stop`` (Gemini's stream too, at times)."""
    for finish in ("stop", None):
        seen = await translated(chunk(call(0, "open_ticket", "{}")), chunk({}, finish=finish))
        assert anthropic_message(seen).stop_reason == "tool_use"
    seen = await translated(chunk(call(0, "open_ticket", '{"ti')), chunk({}, finish="length"))
    assert anthropic_message(seen).stop_reason == "max_tokens"
