"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over chat
completions.

In: ``system`` becomes the system message; ``messages`` with ``text``, ``image``,
``tool_use`` and ``tool_result`` blocks become chat messages (a user turn's tool results first,
as tool messages, then its text; a tool result's images, which a chat tool message cannot hold,
open that user message); a block's texts are joined by a newline, as vLLM joins a message's text
parts, and consecutive turns of one role are one, as Anthropic combines them; client tools,
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``, ``disable_parallel_tool_use``),
``stop_sequences``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``metadata.user_id``,
structured outputs (``output_config.format``) and ``seed`` (not Anthropic's: repeatable
sampling, as on chat) their chat equivalents. A last assistant
turn of text is a prefill: vLLM continues it (``continue_final_message``) and the answer is what
follows it. ``thinking`` is the switch a reasoning model's template reads (off unless asked
for, as on Anthropic's API), and a ``thinking`` block sent back is the assistant message's
``reasoning``, which vLLM hands the template. Out: the model's reasoning (vLLM's reasoning
parser's ``reasoning``) as a thinking block when thinking was asked for, then the chat
answer as a message, its stream as Anthropic's event sequence, and every error (the pipeline's
OpenAI-shaped ones included) in Anthropic's shape, so the ``anthropic`` SDK raises the class it
would against Anthropic. Server tools (web search, code execution...) and MCP servers run on
Anthropic's servers and are refused with a 400 naming the field.

An answer that calls a tool says ``stop_reason: "tool_use"`` whatever its chat finish reason:
vLLM (as OpenAI) finishes a call of a named tool (``tool_choice`` ``tool``) with ``stop``, and an
agent loop reads ``end_turn`` as "do not run the calls".

Which stop sequence ended an answer comes from vLLM's ``stop_reason`` (the matched stop string):
``stop_reason`` ``stop_sequence`` and ``stop_sequence`` that string, as Anthropic answers. A
backend that does not say (the OpenAI-compatible fallback) gives ``end_turn`` and null. Not
knowable from a chat answer: prompt-cache writes (``cache_creation_input_tokens`` 0)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.requests import Request
from starlette.responses import Response

from serve_app import errors, protocol
from serve_app.dialects.base import (
    ToolCallDeltas,
    arguments_object,
    chat_frames,
    chat_message,
    joined,
    joined_content,
    named_event,
    reasoning_of,
    required_string,
    rewrite,
    set_tool_choice,
    thinking_switch,
)
from serve_app.pipeline import RequestContext

# A thinking block's signature. Anthropic signs its models' thinking and checks the signature
# when the block comes back; a model here has nothing to sign, and the gateway checks nothing.
# Not empty: clients read an empty signature as a broken block and send its text back as the
# user's (pydantic-ai: ``_map_thinking_part``), not as the model's reasoning.
UNSIGNED = "forge-unsigned"
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ANTHROPIC_VERSION = "anthropic-version"  # the header every Anthropic SDK call carries
# Anthropic-defined client tools: the client runs them, but their schema is Anthropic's own.
_ANTHROPIC_DEFINED = ("bash_", "text_editor_", "memory_", "computer_")
# Routes whose answers are in Anthropic's shape already: counted tokens, the models' cards.
_ANSWERED_AS_IS = frozenset({"count_tokens", "models"})
# Anthropic's error types by status (its SDK picks the exception class by status alone).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Fields that ask for Anthropic's servers: refused by name rather than silently ignored.
_UNSERVABLE = {
    "mcp_servers": "MCP servers are called by Anthropic's servers; declare their tools as client "
    "tools and call the servers yourself",
    "container": "code execution containers run on Anthropic's servers",
}


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, strict=True)]
    messages: Annotated[list[dict], Field(min_length=1)]
    system: str | list[dict] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: Annotated[float, Field(ge=0, le=1, strict=True)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1, strict=True)] | None = None
    top_k: Annotated[int, Field(ge=0, strict=True)] | None = None
    tools: list[dict] | None = None
    tool_choice: dict | None = None
    metadata: dict | None = None
    output_config: dict | None = None
    output_format: dict | None = None  # the structured-outputs beta's name for the format
    thinking: dict | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None  # not asked here


@dataclass(slots=True)
class Exchange:
    id: str
    model: str
    # What the answer shows of the model's reasoning, by the request's ``thinking``: "shown"
    # (thinking blocks), "omitted" (the blocks, empty: ``display: omitted``) or "hidden".
    thinking: str = "hidden"


class MessagesDialect:
    name = "messages"

    # -- in ----------------------------------------------------------------------------------

    async def to_chat(self, body: dict, ctx: RequestContext) -> dict:
        counting = ctx.api == "count_tokens"
        req = protocol.validate(body, CountTokensRequest if counting else MessagesRequest)
        for name, why in _UNSERVABLE.items():
            if body.get(name):
                raise errors.invalid_request(
                    f"'{name}' is not supported by this gateway: {why}.",
                    param=name,
                    code="unsupported_parameter",
                )
        thinking = _thinking(req.thinking)
        ctx.turn = Exchange("msg_" + uuid.uuid4().hex, req.model, thinking)
        system = _system_text(req.system)
        messages = [{"role": "system", "content": system}] if system else []
        for i, message in enumerate(req.messages):
            for turn in chat_messages(message, f"messages.{i}"):
                _append_turn(messages, turn)
        chat: dict[str, Any] = {"model": req.model, "messages": messages}
        if _prefilled(messages):
            # The answer continues the client's text instead of opening a turn of its own. The
            # fallback drops both fields (``fallback.accepted_params``): it opens a new turn.
            chat["continue_final_message"] = True
            chat["add_generation_prompt"] = False
        if req.max_tokens is not None:
            chat["max_tokens"] = req.max_tokens
        # Thinking is off unless asked for, as on Anthropic's API: a reasoning model's template
        # (Qwen3's, and others') reads the switch; a template without it ignores it.
        chat["chat_template_kwargs"] = thinking_switch(thinking != "hidden")
        if req.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        if req.stop_sequences:
            chat["stop"] = req.stop_sequences
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                chat[name] = getattr(req, name)
        seed = body.get("seed")  # not Anthropic's: sampling made repeatable, as on chat
        if isinstance(seed, int) and not isinstance(seed, bool):
            chat["seed"] = seed
        response_format = chat_response_format(req)
        if response_format is not None:
            chat["response_format"] = response_format
        user = (req.metadata or {}).get("user_id")
        if isinstance(user, str):
            chat["user"] = user
        if req.tools:
            chat["tools"] = chat_tools(req.tools)
        if req.tool_choice is not None:
            choice, parallel = chat_tool_choice(req.tool_choice)
            set_tool_choice(chat, choice)
            if parallel is False:
                chat["parallel_tool_calls"] = False
        return chat

    # -- out ---------------------------------------------------------------------------------

    async def answer(self, ctx: RequestContext, response: Response) -> Response:
        exchange: Exchange | None = ctx.turn
        answer = await rewrite(
            response,
            lambda status, body: self._json(ctx, exchange, status, body),
            lambda chunks: self._stream(ctx, exchange, chunks),
        )
        if ctx.request_id:
            answer.headers["request-id"] = ctx.request_id  # where Anthropic's SDK reads it
        return answer

    async def _json(
        self, ctx: RequestContext, exchange: Exchange | None, status: int, body: dict
    ) -> tuple[int, dict]:
        if status == 200 and ctx.api in _ANSWERED_AS_IS:
            return status, body
        if status != 200 or exchange is None:
            return status, anthropic_error(status, body.get("error") or {}, ctx.request_id)
        choice = (body.get("choices") or [{}])[0]
        text, calls, finish = chat_message(choice)
        content: list[dict] = []
        reasoning = reasoning_of(choice.get("message") or {})
        if reasoning and exchange.thinking != "hidden":
            shown = reasoning if exchange.thinking == "shown" else ""
            content.append({"type": "thinking", "thinking": shown, "signature": UNSIGNED})
        if text:
            content.append({"type": "text", "text": text})
        content += [
            {
                "type": "tool_use",
                "id": c["id"],
                "name": (c.get("function") or {}).get("name", ""),
                "input": arguments_object((c.get("function") or {}).get("arguments", "")),
            }
            for c in calls
        ]
        return status, {
            "id": exchange.id,
            "type": "message",
            "role": "assistant",
            "model": exchange.model,
            "content": content,
            **stop_fields(finish, choice.get("stop_reason"), called=bool(calls)),
            "usage": anthropic_usage(body.get("usage")),
        }

    async def _stream(
        self, ctx: RequestContext, exchange: Exchange | None, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        assert exchange is not None  # a stream is answered only once the body was translated
        start = {
            "id": exchange.id,
            "type": "message",
            "role": "assistant",
            "model": exchange.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # What the gateway counts (its budgets' count, where the tenant has one); the
            # engine's own count comes with message_delta.
            "usage": {**anthropic_usage(None), "input_tokens": ctx.counted_prompt()},
        }
        yield named_event("message_start", {"type": "message_start", "message": start})
        yield named_event("ping", {"type": "ping"})
        block = -1  # the open content block's index
        open_kind = ""  # its type: "thinking", "text" or "tool_use"
        calls = ToolCallDeltas()
        usage, finish, stop_string, failed = None, None, None, False
        async for kind, payload in chat_frames(chunks):
            if kind == "comment":
                yield payload
                continue
            if kind == "error":
                yield named_event("error", anthropic_error(599, payload, ctx.request_id))
                failed = True
                continue  # nothing follows; reading on lets the stream end as it ended
            if payload.get("usage"):
                usage = payload["usage"]
            for choice in payload.get("choices") or ():
                delta = choice.get("delta") or {}
                reasoning = reasoning_of(delta)
                if reasoning and exchange.thinking != "hidden":
                    if open_kind != "thinking":
                        if block >= 0:
                            yield _closed(block, open_kind)
                        block += 1
                        open_kind = "thinking"
                        opening = {"type": "thinking", "thinking": "", "signature": ""}
                        yield _block_start(block, opening)
                    if exchange.thinking == "shown":
                        thought = {"type": "thinking_delta", "thinking": reasoning}
                        yield _block_delta(block, thought)
                content = delta.get("content")
                if isinstance(content, str) and content:
                    if open_kind != "text":
                        if block >= 0:
                            yield _closed(block, open_kind)  # the block before it is complete
                        block += 1
                        open_kind = "text"
                        yield _block_start(block, {"type": "text", "text": ""})
                    yield _block_delta(block, {"type": "text_delta", "text": content})
                for opened, call, arguments in calls.feed(delta):
                    if opened:
                        if block >= 0:
                            yield _closed(block, open_kind)
                        open_kind = "tool_use"
                        block += 1
                        tool = {
                            "type": "tool_use",
                            "id": call["id"],
                            "name": call["function"]["name"],
                            "input": {},
                        }
                        yield _block_start(block, tool)
                    if arguments:
                        yield _block_delta(
                            block, {"type": "input_json_delta", "partial_json": arguments}
                        )
                finish = choice.get("finish_reason") or finish
                stop_string = choice.get("stop_reason") or stop_string
        if failed:
            return
        if block >= 0:
            yield _closed(block, open_kind)
        final = anthropic_usage(usage)
        yield named_event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": stop_fields(finish, stop_string, called=bool(calls.calls)),
                "usage": final,
            },
        )
        yield named_event("message_stop", {"type": "message_stop"})


def stop_fields(finish: str | None, stop_string: object, *, called: bool = False) -> dict:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` from a chat choice's finish reason,
    vLLM's ``stop_reason`` (the stop string that ended it; a token id or null otherwise) and
    whether the answer ``called`` a tool."""
    if called and finish in (None, "stop", "tool_calls"):
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish in (None, "stop") and isinstance(stop_string, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_string}
    return {"stop_reason": _STOP_REASONS.get(finish or "stop", "end_turn"), "stop_sequence": None}


def _block_start(index: int, block: dict) -> bytes:
    return named_event(
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def _block_delta(index: int, delta: dict) -> bytes:
    return named_event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


def _closed(index: int, kind: str) -> bytes:
    """The open block's end; a thinking block's signature first, as Anthropic streams it."""
    if kind != "thinking":
        return _block_stop(index)
    signed = _block_delta(index, {"type": "signature_delta", "signature": UNSIGNED})
    return signed + _block_stop(index)


def _block_stop(index: int) -> bytes:
    return named_event("content_block_stop", {"type": "content_block_stop", "index": index})


def anthropic_usage(usage: dict | None) -> dict:
    usage = usage if isinstance(usage, dict) else {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    # Anthropic's input_tokens leave out what was read from the prompt cache (OpenAI's count it).
    return {
        "input_tokens": max(0, int(usage.get("prompt_tokens") or 0) - cached),
        "output_tokens": int(usage.get("completion_tokens") or 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def speaks_anthropic(request: Request) -> bool:
    """A request from an Anthropic client: on the Messages routes, or with the version header
    Anthropic's SDKs send on every call (``/v1/models``, a path not served)."""
    return request.url.path.startswith("/v1/messages") or ANTHROPIC_VERSION in request.headers


def anthropic_error(status: int, error: dict, request_id: str) -> dict:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = error.get("message") if isinstance(error.get("message"), str) else None
    message = message or "The request failed."
    param = error.get("param")
    if isinstance(param, str) and param and not message.startswith(param):
        message = f"{param}: {message}"  # as Anthropic names the field: there is no param
    return {
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": request_id or None,
    }


# -- the request's parts, translated ----------------------------------------------------------


def chat_messages(message: dict, param: str) -> list[dict]:
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise errors.invalid_request(
            f"Invalid value for '{param}.role': expected user, assistant or system.",
            param=f"{param}.role",
        )
    if role == "system":
        # A mid-conversation system message (Claude Code sends them since 2.1.154): the user's
        # turn here, where it stands. Many templates refuse a system message past the first
        # (Qwen3.5's "System message must be at the beginning", Mistral's, Gemma's), and one
        # folded into the first would change the prompt's start, and so its cached prefix.
        role = "user"
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _not_blocks(param)
    results: list[dict] = []
    parts: list[dict] = []
    calls: list[dict] = []
    thoughts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        where = f"{param}.content.{j}"
        if kind == "text":
            parts.append(
                {"type": "text", "text": required_string(block, "text", where, empty=True)}
            )
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, where)}})
        elif kind == "document" and role == "user":
            parts.append({"type": "text", "text": _document_text(block, where)})
        elif kind == "tool_use" and role == "assistant":
            calls.append(
                {
                    "id": required_string(block, "id", where),
                    "type": "function",
                    "function": {
                        "name": required_string(block, "name", where),
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            text, images = _tool_result(block.get("content") or "", where)
            parts += images  # a chat tool message holds text: its images open the user turn
            if block.get("is_error") is True:
                text = f"Error: {text}"
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": required_string(block, "tool_use_id", where),
                    "content": text,
                }
            )
        elif kind == "thinking" and role == "assistant":
            if isinstance(block.get("thinking"), str) and block["thinking"]:
                thoughts.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # encrypted by Anthropic for its own models: nothing a model here can read
        else:
            raise errors.invalid_request(
                f"Content blocks of type '{kind}' are not supported in a {role} message by this "
                "gateway: it serves text, image and document (user), tool_use (assistant) and "
                "tool_result (user).",
                param=f"{where}.type",
                code="unsupported_parameter",
            )
    out = list(results)
    if role == "assistant":
        turn: dict = {"role": "assistant", "content": joined(parts) if parts else None}
        if calls:
            turn["tool_calls"] = calls
        if thoughts:
            # vLLM hands it to the chat template, which keeps or drops it (Qwen3's keeps the
            # reasoning of the turns since the last user message: a tool loop's own).
            turn["reasoning"] = "\n".join(thoughts)
        out.append(turn)
    elif parts:
        out.append({"role": "user", "content": joined(parts)})
    return out


def _append_turn(messages: list[dict], turn: dict) -> None:
    """``turn`` after ``messages``, combined with the one before it when both are the user's or
    both the assistant's, as Anthropic's API combines consecutive turns: a chat template that
    insists on alternating roles (Gemma's, Mistral's) would refuse them."""
    last = messages[-1] if messages else None
    role = turn["role"]
    if last is None or last["role"] != role or role not in ("user", "assistant"):
        messages.append(turn)
        return
    last["content"] = joined_content(last.get("content"), turn.get("content"))
    if turn.get("tool_calls"):
        last["tool_calls"] = [*last.get("tool_calls", ()), *turn["tool_calls"]]
    if turn.get("reasoning"):
        last["reasoning"] = "\n".join(r for r in (last.get("reasoning"), turn["reasoning"]) if r)


def _not_blocks(where: str) -> errors.ForgeError:
    return errors.invalid_request(
        f"Invalid value for '{where}.content': expected a string or content blocks.",
        param=f"{where}.content",
    )


def _tool_result(content: object, where: str) -> tuple[str, list[dict]]:
    """A ``tool_result``'s text, and its images as chat image parts; a 400 for a block this
    gateway cannot carry (never dropped: the model would answer from a result it never saw)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise _not_blocks(where)
    texts: list[str] = []
    images: list[dict] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "image":
            url = _image_url(part, f"{where}.content.{k}")
            images.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "document":
            texts.append(_document_text(part, f"{where}.content.{k}"))
        else:
            raise errors.invalid_request(
                f"Content blocks of type '{kind}' are not supported in a tool_result by this "
                "gateway: it serves text, image and document.",
                param=f"{where}.content.{k}.type",
                code="unsupported_parameter",
            )
    return "\n".join(texts), images


def _document_text(block: dict, where: str) -> str:
    """A document a model here can read, as text: a plain-text source, or a content source
    (a string, or text blocks), after its title and context. A PDF (base64 or URL) or a file
    needs Anthropic's own reader: a 400, never dropped. Citations are not made."""
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    kind = source.get("type")
    if kind == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "content" and isinstance(source.get("content"), str):
        text = source["content"]
    elif kind == "content" and isinstance(source.get("content"), list):
        text, images = _tool_result(source["content"], f"{where}.source")
        if images:  # a document's images have no place in the text it becomes
            raise _unreadable_document(where, "content with images")
    else:
        raise _unreadable_document(where, kind)
    said = [block.get(k) for k in ("title", "context")]
    return "\n\n".join([*(t for t in said if isinstance(t, str) and t), text])


def _unreadable_document(where: str, kind: object) -> errors.ForgeError:
    return errors.invalid_request(
        f"Documents of source type '{kind}' are not supported by this gateway: it reads text "
        "and content sources (a PDF needs Anthropic's own reader).",
        param=f"{where}.source",
        code="unsupported_parameter",
    )


def _thinking(config: dict | None) -> str:
    """What an answer shows of the model's reasoning ("shown", "omitted", "hidden"), by the
    request's ``thinking``. ``budget_tokens`` is not applied: vLLM's ``thinking_token_budget``
    needs a pool started with a reasoning config, and is a 400 on any other."""
    if config is None:
        return "hidden"
    kind = config.get("type")
    if kind in ("disabled", "between_tools"):  # the latter: thinking off, in Anthropic's words
        return "hidden"
    if kind not in ("enabled", "adaptive"):
        raise errors.invalid_request(
            "Invalid value for 'thinking.type': expected enabled, adaptive, disabled or "
            "between_tools.",
            param="thinking.type",
        )
    display = config.get("display")
    if display not in (None, "summarized", "omitted"):
        raise errors.invalid_request(
            "Invalid value for 'thinking.display': expected summarized or omitted.",
            param="thinking.display",
        )
    return "omitted" if display == "omitted" else "shown"


def _prefilled(messages: list[dict]) -> bool:
    """Whether the conversation ends with the start of the assistant's answer (a prefill)."""
    last = messages[-1] if messages else {}
    return (
        last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
        and bool(last["content"])
        and not last.get("tool_calls")
    )


def chat_response_format(req: MessagesRequest) -> dict | None:
    """Chat's ``response_format`` for structured outputs (``output_config.format``, or the
    beta's ``output_format``): the answer's text is JSON that validates against the schema."""
    fmt = (req.output_config or {}).get("format") or req.output_format
    if fmt is None:
        return None
    param = "output_format" if req.output_format is not None else "output_config.format"
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise errors.invalid_request(
            f"Invalid value for '{param}': expected type json_schema with a 'schema' object.",
            param=param,
        )
    schema = {"name": "output", "schema": fmt["schema"], "strict": True}
    return {"type": "json_schema", "json_schema": schema}


def _system_text(system: str | list[dict] | None) -> str:
    """``system``: a string, or text blocks (all Anthropic takes there), joined as vLLM joins
    text parts; any other block is a 400, never dropped unseen."""
    if system is None or isinstance(system, str):
        return system or ""
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise errors.invalid_request(
                f"Content blocks of type '{kind}' are not supported in 'system': it takes text "
                "blocks.",
                param=f"system.{i}.type",
                code="unsupported_parameter",
            )
        texts.append(required_string(block, "text", f"system.{i}", empty=True))
    return "\n".join(texts)


def _image_url(block: dict, where: str) -> str:
    source = block.get("source")
    source = source if isinstance(source, dict) else {}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    raise errors.invalid_request(
        f"Invalid value for '{where}.source': expected a base64 or url image source.",
        param=f"{where}.source",
    )


def chat_tools(tools: list[dict]) -> list[dict]:
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            why = (
                "its input schema is one only Anthropic's models know"
                if isinstance(kind, str) and kind.startswith(_ANTHROPIC_DEFINED)
                else "server tools run on Anthropic's servers"
            )
            raise errors.invalid_request(
                f"Tools of type '{kind}' are not supported by this gateway: {why}; declare a "
                "client tool (name, input_schema).",
                param=f"tools.{i}.type",
                code="unsupported_tool",
            )
        name = required_string(tool, "name", f"tools.{i}")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise errors.invalid_request(
                f"Invalid value for 'tools.{i}.input_schema': expected a JSON schema object.",
                param=f"tools.{i}.input_schema",
            )
        function: dict = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        if tool.get("strict") is True:  # arguments held to the schema (vLLM's grammar)
            function["strict"] = True
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict) -> tuple[str | dict, bool | None]:
    """Chat's ``tool_choice``, and False when parallel calls are turned off."""
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise errors.invalid_request(
        "Invalid value for 'tool_choice': expected type auto, any, none, or tool with a name.",
        param="tool_choice",
    )
