"""What every dialect shares: the seam at the edge, and reading a chat answer back.

A dialect speaks one public API (OpenAI's Responses, Anthropic's Messages) at the edge and chat
completions inside. ``ParseStage`` asks it for the chat body before quota, cache, admission and
dispatch see the request; the gateway's route asks it to answer in its own shape with what the
pipeline returned (a chat completion, a chat SSE stream, or an OpenAI-shaped error). So every
stage, every backend and the fallback serve one protocol, and a budget, a cached answer, a
failover or a metered token is the same on every route. What a chat completion cannot carry
(a built-in tool, a background run) is refused here, before any budget is spent on it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson
from starlette.responses import Response, StreamingResponse

from serve_app import errors, protocol, sse
from serve_app.pipeline import RequestContext
from serve_app.protocol import REASONING_FIELDS


class Dialect(Protocol):
    name: str  # the route's own name: "responses", "messages"

    async def to_chat(self, body: dict, ctx: RequestContext) -> dict:
        """The chat completions body for ``body``; a 400 naming the client's field if it is
        not one this dialect can translate."""
        ...

    async def answer(self, ctx: RequestContext, response: Response) -> Response:
        """The pipeline's ``response`` in this dialect's shape."""
        ...


def set_tool_choice(chat: dict, choice: str | dict) -> None:
    """``choice`` on the chat body, except auto or none without tools: OpenAI's and Anthropic's
    APIs take those alone, vLLM refuses a tool_choice with no tools."""
    if "tools" in chat or choice not in ("auto", "none"):
        chat["tool_choice"] = choice


async def count_tokens(ctx: RequestContext) -> Response:
    """``/v1/messages/count_tokens`` and ``/v1/responses/input_tokens``: the gateway's count of
    the translated prompt, the one its budgets reserve (the engine's own tokenizer may differ
    by a few tokens), as ``{"input_tokens": n}``; each dialect answers it in its shape."""
    if not ctx.model_served:  # parse leaves an unknown model to dispatch, which counting skips
        raise errors.model_not_found(ctx.model_name)
    tokens = protocol.count_prompt_tokens(ctx.body or {}, "chat")
    return Response(orjson.dumps({"input_tokens": tokens}), media_type="application/json")


async def rewrite(
    response: Response,
    json_body: Callable[[int, dict], Awaitable[tuple[int, dict]]],
    stream: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]],
) -> Response:
    """``response`` with its body translated. A stream keeps its object (the stages' end
    callbacks hang off it) and gets a translated body; a JSON answer is read and rebuilt."""
    if isinstance(response, StreamingResponse):
        response.body_iterator = stream(response.body_iterator)
        return response
    return await _rebuilt(response, json_body)


async def _rebuilt(
    response: Response, json_body: Callable[[int, dict], Awaitable[tuple[int, dict]]]
) -> Response:
    try:
        body = orjson.loads(response.body)
    except orjson.JSONDecodeError:
        return response
    if not isinstance(body, dict):
        return response
    status, out = await json_body(response.status_code, body)
    headers = {
        k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")
    }
    return Response(
        orjson.dumps(out), status_code=status, headers=headers, media_type="application/json"
    )


async def chat_frames(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[str, Any]]:
    """A chat SSE stream as ``("chunk", dict)``, ``("error", dict)`` (the OpenAI error body a
    stream ends with when it fails after its first byte) and ``("comment", bytes)`` (a
    keep-alive, passed on as it is); ``[DONE]`` ends it. The inner stream is closed however
    the reading ends, so its generation is aborted when the client leaves."""
    ended = False
    try:
        async for events in sse.split_frames(chunks):
            for event in events:
                # Read to its end past ``[DONE]`` or an error (nothing follows them): a stream
                # left unfinished counts as one its client left (499).
                if ended:
                    continue
                if not any(line.startswith(b"data:") for line in event.split(b"\n")):
                    yield "comment", event
                    continue
                data = sse.frame_data(event)
                if data == b"[DONE]":
                    ended = True
                    continue
                try:
                    payload = orjson.loads(data)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
                    ended = True
                    yield "error", payload["error"]
                elif isinstance(payload, dict):
                    yield "chunk", payload
    finally:
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()


def named_event(kind: str, payload: dict) -> bytes:
    """One SSE event with an ``event:`` line, as both APIs stream them."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def text_of(content: Any, *kinds: str, sep: str = "") -> str:
    """The text of a content field: a string, or the ``text`` of the parts of ``kinds``, joined
    by ``sep``."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return sep.join(
        p["text"]
        for p in content
        if isinstance(p, dict) and p.get("type") in kinds and isinstance(p.get("text"), str)
    )


def required_string(obj: dict, name: str, where: str, *, empty: bool = False) -> str:
    """``obj[name]``, a string (non-empty unless ``empty``), or a 400 naming ``where.name``."""
    value = obj.get(name)
    if not isinstance(value, str) or (not value and not empty):
        raise errors.invalid_request(
            f"Missing required parameter: '{where}.{name}'.",
            param=f"{where}.{name}",
            code="missing_required_parameter",
        )
    return value


def arguments_object(arguments: str) -> dict:
    """A tool call's arguments as an object (Anthropic's ``input``): ``{}`` for what a model
    cut short or got wrong, which the client's tool then refuses with its own message."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def chat_message(choice: dict) -> tuple[str, list[dict], str | None]:
    """A chat completion choice's text, tool calls and finish reason. A call the backend gave
    no id gets one, once, as ``ToolCallDeltas`` gives a streamed one."""
    message = choice.get("message") or {}
    text = message.get("content") if isinstance(message.get("content"), str) else ""
    calls = [
        c if c.get("id") else {**c, "id": _call_id()}
        for c in message.get("tool_calls") or ()
        if isinstance(c, dict)
    ]
    return text or "", calls, choice.get("finish_reason")


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex


def reasoning_of(message: dict) -> str:
    """The reasoning a chat message (or a stream's delta) carries, "" if none."""
    for name in REASONING_FIELDS:
        value = message.get(name)
        if isinstance(value, str) and value:
            return value
    return ""


def joined(parts: list[dict]) -> str | list[dict]:
    """Chat content parts as a message's content: text only is one string, joined by a newline
    as vLLM joins a message's text parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def joined_content(first: str | list[dict] | None, then: str | list[dict] | None):
    """Two messages' contents as one message's (None if both have none)."""
    parts = [p for c in (first, then) for p in _as_parts(c)]
    return joined(parts) if parts else None


def _as_parts(content: str | list[dict] | None) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content or ())


def system_first(messages: list[dict]) -> list[dict]:
    """One system message, first: the system messages before any turn joined into it, and a
    later one the user's, where it stands; the user's consecutive messages one. Many templates
    refuse a system message past the first (Qwen3.5's "System message must be at the
    beginning", Mistral's, Gemma's), and some roles that do not alternate (Gemma's, Mistral's).
    """
    out: list[dict] = []
    for message in messages:
        role = message["role"]
        if role == "system" and all(m["role"] == "system" for m in out):
            if out:
                out[0] = {
                    **out[0],
                    "content": joined_content(out[0]["content"], message["content"]),
                }
            else:
                out.append(message)
            continue
        if role == "system":
            message = {**message, "role": "user"}
        if message["role"] == "user" and out and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": joined_content(out[-1]["content"], message["content"])}
            continue
        out.append(message)
    return out


def thinking_switch(on: bool) -> dict:
    """The ``chat_template_kwargs`` that turn a reasoning model's thinking on or off, under
    both names templates read: ``enable_thinking`` (Qwen3's, GLM's) and ``thinking``
    (DeepSeek V3.1's, Granite's). vLLM hands a template only the names it uses."""
    return {"enable_thinking": on, "thinking": on}


def assistant_turn(text: str, calls: list[dict], reasoning: str = "") -> dict:
    """What the model said, as a chat message a follow-up sends back (a call's thought
    signature included: Gemini wants it back; the model's reasoning too, which vLLM hands the
    chat template as ``reasoning``, and a reasoning model's template keeps within a tool loop)."""
    message: dict = {"role": "assistant", "content": text or None}
    if reasoning:
        message["reasoning"] = reasoning
    if calls:
        message["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": (c.get("function") or {}).get("name", ""),
                    "arguments": (c.get("function") or {}).get("arguments", ""),
                },
                **({"extra_content": c["extra_content"]} if "extra_content" in c else {}),
            }
            for c in calls
        ]
    return message


class ToolCallDeltas:
    """Chat tool-call deltas gathered per call index: what both streams announce as the call
    opens (its id and name), and its arguments as they arrive. A call the backend gave no id
    gets one here, once, so the answer and the history a follow-up sends agree on it; a
    Gemini thought signature (``extra_content``) stays with its call, for the follow-up."""

    def __init__(self) -> None:
        self.calls: dict[int, dict] = {}

    def feed(self, delta: dict) -> list[tuple[bool, dict, str]]:
        """``(opened, call, new_arguments)`` per tool call ``delta`` carries."""
        out = []
        for part in delta.get("tool_calls") or ():
            if not isinstance(part, dict):
                continue
            index = part.get("index", 0)
            function = part.get("function") or {}
            call = self.calls.get(index)
            opened = call is None
            if call is None:
                call = self.calls[index] = {
                    "id": part.get("id") or _call_id(),
                    "type": "function",
                    "function": {"name": function.get("name") or "", "arguments": ""},
                }
            if isinstance(part.get("extra_content"), dict):
                call["extra_content"] = part["extra_content"]
            arguments = function.get("arguments") or ""
            call["function"]["arguments"] += arguments
            out.append((opened, call, arguments))
        return out

    def all(self) -> list[dict]:
        return [self.calls[i] for i in sorted(self.calls)]
