"""OpenAI's Responses API (``POST /v1/responses``) over chat completions.

In: ``instructions`` become the system message; ``input`` (text, or items: messages,
``function_call``, ``function_call_output``) the messages after the conversation that
``previous_response_id`` names (``developer`` and system messages before any turn joined to
the instructions in one system message, as every chat template takes it, and a later one the
user's, where it stands; a function output's images, which a chat tool message cannot hold,
as a user message after the tool messages); function tools, ``tool_choice``,
``parallel_tool_calls``, ``text.format`` (``json_schema``, ``json_object``),
``max_output_tokens``, ``temperature``, ``top_p`` and ``user`` their chat equivalents;
``reasoning.effort`` is also the switch a reasoning model's template reads, and a ``reasoning``
item's text is the next assistant message's ``reasoning``. Out: the chat answer as a response
object (the model's reasoning first, as a reasoning item), or its stream as the Responses event
sequence the official client parses. Built-in tools (web search, file search, code interpreter...),
``background``, ``conversation`` and reusable ``prompt`` templates need OpenAI's servers; they
are refused with a 400 naming the field, on every backend alike, so nothing accepted here is
unservable by the fallback.

OpenAI's own behaviours kept: ``store`` defaults to true; ``instructions`` are not carried
over from a previous response; ``metadata`` is echoed and stored, never sent to the model.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from starlette.requests import Request
from starlette.responses import Response

from serve_app import errors, protocol
from serve_app.dialects.base import (
    ToolCallDeltas,
    assistant_turn,
    chat_frames,
    chat_message,
    named_event,
    reasoning_of,
    required_string,
    rewrite,
    set_tool_choice,
    system_first,
    thinking_switch,
)
from serve_app.dialects.stored import StoredResponses
from serve_app.engines.truncation import TRUNCATE_KEY
from serve_app.pipeline import RequestContext

_JSON = "application/json"
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# Fields that ask for OpenAI's servers: refused by name rather than silently ignored.
_UNSERVABLE = {
    "background": "background runs need OpenAI's job queue; send the request and wait for it",
    "conversation": "the Conversations API is not served here; use previous_response_id",
    "prompt": "reusable prompt templates live on OpenAI's platform; send the text itself",
}


LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1)]
    input: str | Annotated[list[dict], Field(min_length=1)]
    instructions: str | None = None
    # The SDK's types allow null for both (and send it when told None): null is the default.
    stream: StrictBool | None = False
    store: StrictBool | None = True
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, strict=True)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1, strict=True)] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict | None = None
    # OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512. Stored with the
    # response and never sent to the model, so it costs no tokens: unbounded, one tenant's
    # metadata would evict every tenant's stored conversations from the shared store.
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Log-probabilities come with the text where ``include`` asks for them (OpenAI's
    # "message.output_text.logprobs"); ``top_logprobs`` alternatives each (vLLM gives 20).
    include: list[str] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20, strict=True)] | None = None

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


@dataclass(slots=True)
class Turn:
    """One response being made: what its object echoes, and what a follow-up continues."""

    id: str
    request: ResponsesRequest
    body: dict  # the client's JSON: tools and text format echoed as they were sent
    history: list[dict]  # the conversation before this turn's output, without instructions
    tenant: str
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        status: str,
        output: list[dict],
        usage: dict | None,
        *,
        error: dict | None = None,
        incomplete: str | None = None,
    ) -> dict:
        req = self.request
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": req.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "text": {"format": {"type": "text"}, **(self.body.get("text") or {})},
            "tool_choice": self.body.get("tool_choice", "auto"),
            "tools": self.body.get("tools") or [],
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "top_logprobs": req.top_logprobs,
            "truncation": req.truncation or "disabled",
            "reasoning": _echoed_reasoning(self.body.get("reasoning")),
            "usage": usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }


def _echoed_reasoning(reasoning: object) -> dict:
    """The request's ``reasoning`` as the response echoes it (OpenAI's shape when none)."""
    if isinstance(reasoning, dict):
        return reasoning
    return {"effort": None, "summary": None}


class ResponsesDialect:
    name = "responses"

    def __init__(self, stored: StoredResponses) -> None:
        self.stored = stored

    # -- in ----------------------------------------------------------------------------------

    async def to_chat(self, body: dict, ctx: RequestContext) -> dict:
        for name, why in _UNSERVABLE.items():
            if body.get(name) not in (None, False):
                raise _unsupported(f"'{name}' is not supported by this gateway: {why}.", name)
        req = protocol.validate(body, ResponsesRequest)
        req.stream = bool(req.stream)
        req.store = req.store is not False
        history: list[dict] = []
        if req.previous_response_id is not None:
            record = await self.stored.get(ctx.tenant_name, req.previous_response_id)
            if record is None:
                raise errors.ForgeError(
                    404,
                    f"Previous response with id '{req.previous_response_id}' not found.",
                    type="invalid_request_error",
                    code="previous_response_not_found",
                    param="previous_response_id",
                )
            history = list(record.get("messages") or ())
        history += input_messages(req.input)
        ctx.turn = Turn("resp_" + uuid.uuid4().hex, req, body, history, ctx.tenant_name)
        messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat: dict[str, Any] = {"model": req.model, "messages": system_first(messages + history)}
        if req.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        for ours, theirs in (
            ("max_output_tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("user", "user"),
            ("parallel_tool_calls", "parallel_tool_calls"),
        ):
            value = getattr(req, ours)
            if value is not None:
                chat[theirs] = value
        if req.logprobs:
            chat["logprobs"] = True
            chat["top_logprobs"] = req.top_logprobs or 0
        if req.tools:
            chat["tools"] = chat_tools(req.tools)
        if req.tool_choice is not None:
            set_tool_choice(chat, chat_tool_choice(req.tool_choice))
        response_format = chat_response_format(req.text)
        if response_format is not None:
            chat["response_format"] = response_format
        effort = (
            (body.get("reasoning") or {}).get("effort")
            if isinstance(body.get("reasoning"), dict)
            else None
        )
        if isinstance(effort, str):
            chat["reasoning_effort"] = effort
            # An effort asks for reasoning, "none" for none: the switch a reasoning model's
            # template reads (a template without one ignores it).
            chat["chat_template_kwargs"] = thinking_switch(effort != "none")
        if req.truncation == "auto":  # the replica drops the oldest turns that do not fit
            chat[TRUNCATE_KEY] = "auto"
        seed = body.get("seed")  # not OpenAI's: sampling made repeatable, as on chat
        if isinstance(seed, int) and not isinstance(seed, bool):
            chat["seed"] = seed
        return chat

    # -- out ---------------------------------------------------------------------------------

    async def answer(self, ctx: RequestContext, response: Response) -> Response:
        turn: Turn | None = ctx.turn
        if turn is None:  # refused before the body was read (a 401, a 413): OpenAI's shape
            return response
        if ctx.api == "input_tokens":
            return await rewrite(response, _counted, lambda chunks: chunks)
        return await rewrite(
            response,
            lambda status, body: self._json(turn, status, body),
            lambda chunks: self._stream(turn, chunks),
        )

    async def _json(self, turn: Turn, status: int, body: dict) -> tuple[int, dict]:
        if status != 200 or not body.get("choices"):
            return status, _in_responses_terms(body)  # OpenAI's error shape is this API's too
        text, calls, finish = chat_message(body["choices"][0])
        reasoning = reasoning_of(body["choices"][0].get("message") or {})
        said = _logprobs(body["choices"][0])
        output = ([reasoning_item(reasoning, "completed")] if reasoning else []) + (
            [message_item(text, "completed", said)] if text else []
        )
        namespaces = tool_namespaces(turn.request.tools)
        output += [function_call_item(c, "completed", namespaces) for c in calls]
        incomplete = "max_output_tokens" if finish == "length" else None
        if incomplete and output:
            output[-1]["status"] = "incomplete"  # the item the limit cut, as OpenAI marks it
        obj = turn.response(
            "incomplete" if incomplete else "completed",
            output,
            responses_usage(body.get("usage")),
            incomplete=incomplete,
        )
        await self._keep(turn, obj, text, calls, reasoning)
        return status, obj

    async def _keep(
        self, turn: Turn, obj: dict, text: str, calls: list[dict], reasoning: str
    ) -> None:
        if turn.request.store:
            said = assistant_turn(text, calls, reasoning)
            record = {"response": obj, "messages": [*turn.history, said]}
            await self.stored.put(turn.tenant, turn.id, record)

    async def _stream(self, turn: Turn, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        events = _Events()
        started = turn.response("in_progress", [], None)
        yield events("response.created", response=started)
        yield events("response.in_progress", response=started)
        output: list[dict] = []
        thought: dict | None = None  # the reasoning item, while it is open
        reasoning: list[str] = []  # all of the answer's reasoning
        message: dict | None = None  # the text item, while it is open
        text: list[str] = []  # all of the answer's text
        message_text: list[str] = []  # the open text item's
        message_logprobs: list[dict] = []  # and its tokens' log-probabilities, where asked
        reasoning_start = 0  # where the open reasoning item's text starts in ``reasoning``
        calls = ToolCallDeltas()
        namespaces = tool_namespaces(turn.request.tools)
        items: dict[int, tuple[int, dict]] = {}  # id() of a gathered call → (index, its item)
        open_call: tuple[int, dict] | None = None  # the call item whose arguments are streaming
        usage, finish, failed = None, None, False
        async for kind, payload in chat_frames(chunks):
            if kind == "comment":
                yield payload
                continue
            if kind == "error":
                error = failed_error(payload)
                # What was said before the failure stays in the output, cut off where it was.
                if message is not None:
                    message["content"] = [_text_part("".join(message_text), message_logprobs)]
                if thought is not None:
                    said = "".join(reasoning[reasoning_start:])
                    thought["content"] = [_reasoning_part(said)]
                for item in output:
                    if item.get("status") == "in_progress":
                        item["status"] = "incomplete"
                yield events(
                    "response.failed",
                    response=turn.response("failed", output, usage, error=error),
                )
                failed = True
                continue  # nothing follows; reading on lets the stream end as it ended
            if payload.get("usage"):
                usage = payload["usage"]
            for choice in payload.get("choices") or ():
                delta = choice.get("delta") or {}
                piece = reasoning_of(delta)
                if piece:
                    if thought is None:
                        thought = reasoning_item("", "in_progress")
                        thought_index, reasoning_start = len(output), len(reasoning)
                        output.append(thought)
                        for event in _opened(events, thought_index, thought, _reasoning_part("")):
                            yield event
                    reasoning.append(piece)
                    kind = "response.reasoning_text.delta"
                    yield _part_event(events, kind, thought_index, thought, delta=piece)
                content = delta.get("content")
                if thought is not None and (
                    (isinstance(content, str) and content) or delta.get("tool_calls")
                ):
                    said = "".join(reasoning[reasoning_start:])
                    for event in _reasoning_done(events, thought_index, thought, said):
                        yield event
                    thought = None
                if isinstance(content, str) and content:
                    if message is None:
                        message = message_item("", "in_progress")
                        message_index, message_text, message_logprobs = len(output), [], []
                        output.append(message)
                        for event in _opened(events, message_index, message, _text_part("")):
                            yield event
                    text.append(content)
                    message_text.append(content)
                    said = _logprobs(choice)
                    message_logprobs += said
                    kind = "response.output_text.delta"
                    yield _part_event(
                        events, kind, message_index, message, delta=content, logprobs=said
                    )
                for opened, call, arguments in calls.feed(delta):
                    if opened:
                        if message is not None:  # the text before the calls is done
                            done = _text_done(
                                events, message_index, message, message_text, message_logprobs
                            )
                            for event in done:
                                yield event
                            message = None
                        if open_call is not None:  # one call at a time, as OpenAI streams them
                            for event in _call_done(events, *open_call):
                                yield event
                        item = function_call_item(call, "in_progress", namespaces)
                        item["arguments"] = ""
                        items[id(call)] = open_call = (len(output), item)
                        output.append(item)
                        yield events(
                            "response.output_item.added", output_index=len(output) - 1, item=item
                        )
                    index, item = items[id(call)]
                    if arguments:
                        item["arguments"] += arguments
                        if item["status"] == "in_progress":  # else a late delta: kept, not told
                            yield events(
                                "response.function_call_arguments.delta",
                                item_id=item["id"],
                                output_index=index,
                                delta=arguments,
                            )
                finish = choice.get("finish_reason") or finish
        if failed:
            return
        incomplete = "max_output_tokens" if finish == "length" else None
        # The item the limit cut ends incomplete, as OpenAI marks it; the ones before, done.
        ending = "incomplete" if incomplete else "completed"
        if thought is not None:
            said = "".join(reasoning[reasoning_start:])
            for event in _reasoning_done(events, thought_index, thought, said, ending):
                yield event
        if message is not None:
            done = _text_done(
                events, message_index, message, message_text, message_logprobs, ending
            )
            for event in done:
                yield event
        if open_call is not None:
            for event in _call_done(events, *open_call, ending):
                yield event
        obj = turn.response(
            "incomplete" if incomplete else "completed",
            output,
            responses_usage(usage),
            incomplete=incomplete,
        )
        await self._keep(turn, obj, "".join(text), calls.all(), "".join(reasoning))
        yield events("response.incomplete" if incomplete else "response.completed", response=obj)

    # -- stored responses: GET and DELETE /v1/responses/{id} ---------------------------------

    async def stored_response(self, ctx: RequestContext) -> Response:
        request: Request = ctx.request
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            if not await self.stored.delete(ctx.tenant_name, response_id):
                raise _no_response(response_id)
            body = {"id": response_id, "object": "response.deleted", "deleted": True}
            return Response(orjson.dumps(body), media_type=_JSON)
        record = await self.stored.get(ctx.tenant_name, response_id)
        if record is None or not isinstance(record.get("response"), dict):
            raise _no_response(response_id)
        return Response(orjson.dumps(record["response"]), media_type=_JSON)


async def _counted(status: int, body: dict) -> tuple[int, dict]:
    """``/v1/responses/input_tokens``'s answer, as OpenAI's API shapes it."""
    if status != 200:
        return status, _in_responses_terms(body)
    return status, {"object": "response.input_tokens", **body}


# Chat's names of the fields an error may name, as the Responses API calls them.
_FIELD_NAMES = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "reasoning_effort": "reasoning.effort",
}


def _in_responses_terms(body: dict) -> dict:
    """An error about the translated body, naming the client's field (``max_output_tokens``,
    not the chat body's ``max_tokens`` that vLLM or the budget refused)."""
    error = body.get("error")
    param = error.get("param") if isinstance(error, dict) else None
    named = _FIELD_NAMES.get(param) if isinstance(param, str) else None
    if named is None:
        return body
    message = error.get("message")
    if isinstance(message, str):
        message = message.replace(f"{param}=", f"{named}=").replace(f"'{param}'", f"'{named}'")
    return {**body, "error": {**error, "param": named, "message": message}}


class _Events:
    """Responses stream events, numbered as the API numbers them."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return named_event(kind, payload)


def _text_done(
    events: _Events,
    index: int,
    message: dict,
    text: list[str],
    logprobs: list[dict],
    status: str = "completed",
) -> list[bytes]:
    """The open text item's closing events; its text is what was said so far."""
    said = "".join(text)
    message["status"] = status
    part = _text_part(said, logprobs)
    message["content"] = [part]
    done = "response.output_text.done"
    return _closed(events, index, message, done, part, text=said, logprobs=logprobs)


def _call_done(events: _Events, index: int, item: dict, status: str = "completed") -> list[bytes]:
    """A function call item's closing events, once the next call opens or the answer ends."""
    item["status"] = status
    return [
        events(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=index,
            name=item["name"],
            arguments=item["arguments"],
        ),
        events("response.output_item.done", output_index=index, item=item),
    ]


def _opened(events: _Events, index: int, item: dict, part: dict) -> list[bytes]:
    """An item opened, with its one content part."""
    return [
        events("response.output_item.added", output_index=index, item=item),
        _part_event(events, "response.content_part.added", index, item, part=part),
    ]


def _reasoning_done(
    events: _Events, index: int, item: dict, said: str, status: str = "completed"
) -> list[bytes]:
    """The open reasoning item's closing events, once the answer's text or calls begin."""
    item["status"] = status
    item["content"] = [_reasoning_part(said)]
    item["encrypted_content"] = sealed(said)
    done = "response.reasoning_text.done"
    return _closed(events, index, item, done, _reasoning_part(said), text=said)


def _closed(
    events: _Events, index: int, item: dict, done: str, part: dict, **fields: Any
) -> list[bytes]:
    """An item's one content part closed: the part's ``done`` event, then the part's, then the
    item's."""
    return [
        _part_event(events, done, index, item, **fields),
        _part_event(events, "response.content_part.done", index, item, part=part),
        events("response.output_item.done", output_index=index, item=item),
    ]


def _part_event(events: _Events, kind: str, index: int, item: dict, **fields: Any) -> bytes:
    """An event about the item's (only) content part."""
    return events(kind, item_id=item["id"], output_index=index, content_index=0, **fields)


def _reasoning_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(text: str, status: str) -> dict:
    """The model's reasoning (vLLM's reasoning parser's ``reasoning``) as a reasoning item: its
    text as ``content``, as OpenAI's open-weight models' are, and sealed as
    ``encrypted_content``; no summary is made of it."""
    item = {
        "id": "rs_" + uuid.uuid4().hex,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [_reasoning_part(text)] if text else [],
    }
    if text:
        item["encrypted_content"] = sealed(text)
    return item


# A reasoning item's ``encrypted_content``: its text, readable back by this gateway only in the
# sense that OpenAI's is by OpenAI (it is no secret: the text is in ``content`` too). Clients
# that replay reasoning by it keep it: LangChain sends back a streamed item as its
# ``output_item.added`` (no text yet) plus the ``encrypted_content`` of its ``.done``, and with
# ``store: false`` drops every reasoning item without one.
_SEALED = "forge.reasoning.v1:"


def sealed(text: str) -> str:
    return _SEALED + base64.b64encode(text.encode()).decode()


def _unsealed(value: object) -> str:
    """A sealed reasoning's text; "" for another's (OpenAI's is OpenAI's alone to read)."""
    if not isinstance(value, str) or not value.startswith(_SEALED):
        return ""
    try:
        return base64.b64decode(value[len(_SEALED) :], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        return ""


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(choice: dict) -> list[dict]:
    """A chat choice's (or chunk's) token log-probabilities, as an output text's: the same
    entries (token, logprob, bytes, top_logprobs); none where none were asked."""
    content = (choice.get("logprobs") or {}).get("content")
    return [entry for entry in content if isinstance(entry, dict)] if content else []


def message_item(text: str, status: str, logprobs: list[dict] | None = None) -> dict:
    return {
        "id": "msg_" + uuid.uuid4().hex,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [_text_part(text, logprobs)] if text else [],
    }


def function_call_item(call: dict, status: str, namespaces: dict[str, str] | None = None) -> dict:
    """A chat tool call as a ``function_call`` item; a namespaced function's with its
    ``namespace``, which the client routes the call by."""
    function = call.get("function") or {}
    name = function.get("name", "")
    item = {
        "id": "fc_" + uuid.uuid4().hex,
        "type": "function_call",
        "status": status,
        "call_id": call["id"],  # given by the backend, or by this gateway once
        "name": name,
        "arguments": function.get("arguments", ""),
    }
    namespace = (namespaces or {}).get(name)
    if namespace is not None:
        item["namespace"] = namespace
    return item


# The codes a ``response.failed`` error may carry (the SDK's ``ResponseError.code``); others
# are a server error, with the gateway's own code kept as its ``type``.
_FAILED_CODES = frozenset({"server_error", "rate_limit_exceeded", "invalid_prompt"})


def failed_error(error: dict) -> dict:
    """A stream's error (OpenAI's shape) as a ``response.failed`` response's ``error``."""
    code = error.get("code")
    return {
        "code": code if code in _FAILED_CODES else "server_error",
        "message": error.get("message") or "The model backend failed.",
        "type": code if isinstance(code, str) else error.get("type"),
    }


def responses_usage(usage: dict | None) -> dict | None:
    if not isinstance(usage, dict):
        return None
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": prompt,
        # No prompt-cache writes are known of a chat answer (the SDK's type requires the field).
        "input_tokens_details": {"cached_tokens": int(cached), "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": int(reasoning)},
        "total_tokens": prompt + completion,
    }


# -- the request's parts, translated ----------------------------------------------------------


def input_messages(value: str | list[dict]) -> list[dict]:
    """``input`` as chat messages: a text is the user's; items keep their order, and an
    assistant's text and the function calls after it are one assistant message, as chat
    completions has them."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    images: list[dict] = []  # the function outputs' images, after their run of tool messages
    thoughts: list[str] = []  # reasoning items' text, for the assistant message after them
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        param = f"input.{i}"
        if images and kind != "function_call_output":
            messages.append({"role": "user", "content": images})
            images = []
        if kind != "reasoning" and thoughts:
            if kind == "function_call" or (kind == "message" and item.get("role") == "assistant"):
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "reasoning" not in last:
                    # Its text before the reasoning (an order replays can have): one turn still.
                    last["reasoning"] = "\n".join(thoughts)
                else:
                    messages.append({"role": "assistant", "content": None})
                    messages[-1]["reasoning"] = "\n".join(thoughts)
            thoughts = []  # reasoning followed by no answer of its own is not the model's turn
        if kind == "message":
            _append_message(messages, _message(item, param))
        elif kind == "function_call":
            call = {
                "id": required_string(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": required_string(item, "name", param),
                    "arguments": required_string(item, "arguments", param, empty=True),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, str):
                text = output
            elif isinstance(output, list):
                parts = _parts(output, f"{param}.output", ("input_text",))
                text = "\n".join(p["text"] for p in parts if p["type"] == "text")
                # A chat tool message holds text: a tool's images follow it as the user's.
                images += [p for p in parts if p["type"] == "image_url"]
            else:
                raise errors.invalid_request(
                    f"Invalid value for '{param}.output': expected a string or content parts.",
                    param=f"{param}.output",
                )
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": required_string(item, "call_id", param),
                    "content": text,
                }
            )
        elif kind == "reasoning":
            thoughts += _reasoning_texts(item)
        else:
            raise _unsupported(
                f"Input items of type '{kind}' are not supported by this gateway: it serves "
                "messages, function_call and function_call_output items.",
                f"{param}.type",
            )
    if images:
        messages.append({"role": "user", "content": images})
    return messages


def _append_message(messages: list[dict], message: dict) -> None:
    """``message`` after ``messages``; an assistant's text joins the reasoning item's message
    just before it (reasoning, then the text it led to, are one chat message)."""
    last = messages[-1] if messages else None
    if (
        message["role"] == "assistant"
        and last is not None
        and last["role"] == "assistant"
        and last.get("content") is None
        and "reasoning" in last
        and not last.get("tool_calls")
    ):
        last["content"] = message["content"]
        return
    messages.append(message)


def _reasoning_texts(item: dict) -> list[str]:
    """A reasoning item's text: its ``content`` (the model's own, as this gateway returns it),
    else its summary (an OpenAI model's), else what this gateway sealed in it."""
    for field_name, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field_name)
        texts = [
            p["text"]
            for p in (parts if isinstance(parts, list) else ())
            if isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str)
        ]
        if any(texts):
            return [t for t in texts if t]
    text = _unsealed(item.get("encrypted_content"))
    return [text] if text else []


def _message(item: dict, param: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise errors.invalid_request(
            f"Invalid value for '{param}.role': expected user, assistant, system or developer.",
            param=f"{param}.role",
        )
    # OpenAI's developer messages are system messages on a chat model's template: a template
    # that knows no developer role (Qwen2.5's, Llama's) would leave them out of the prompt
    # (``system_first`` then keeps them where every template takes them).
    role = "system" if role == "developer" else role
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise errors.invalid_request(
            f"Invalid value for '{param}.content': expected a string or content parts.",
            param=f"{param}.content",
        )
    parts = _parts(content, f"{param}.content", _TEXT_PARTS)
    if all(p["type"] == "text" for p in parts):
        # Joined as vLLM joins a message's text parts for a template that takes a string.
        return {"role": role, "content": "\n".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _parts(content: list, param: str, text_kinds: tuple[str, ...]) -> list[dict]:
    """Content parts as chat parts: text (an empty one too) and images by URL; a 400 naming
    any other part, never a part silently dropped."""
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if kind else None
        if kind in text_kinds and isinstance(text, str):
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            image: dict = {"url": part["image_url"]}
            if part.get("detail") in ("low", "high", "auto"):
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise _unsupported(
                f"Content parts of type '{kind}' are not supported here by this gateway: it "
                f"serves {', '.join(text_kinds)} and input_image (by URL).",
                f"{param}.{j}.type",
            )
    return parts


def chat_tools(tools: list[dict]) -> list[dict]:
    """Function tools as chat's; a namespace's functions as function tools of their own names
    (their calls say the namespace again: ``tool_namespaces``)."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") == "namespace" and isinstance(tool.get("tools"), list):
            out += [_chat_function(t, f"tools.{i}.tools.{j}") for j, t in enumerate(tool["tools"])]
        else:
            out.append(_chat_function(tool, f"tools.{i}"))
    names = [t["function"]["name"] for t in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise errors.invalid_request(
            f"Tool names must be unique across namespaces here: {', '.join(twice)}.",
            param="tools",
        )
    return out


def tool_namespaces(tools: list[dict] | None) -> dict[str, str]:
    """The namespace of each namespaced function, by the function's name."""
    return {
        inner.get("name"): tool.get("name")
        for tool in tools or ()
        if tool.get("type") == "namespace" and isinstance(tool.get("tools"), list)
        for inner in tool["tools"]
        if isinstance(inner, dict)
    }


def _chat_function(tool: object, where: str) -> dict:
    if not isinstance(tool, dict):
        raise errors.invalid_request(
            f"Invalid value for '{where}': expected a tool object.", param=where
        )
    kind = tool.get("type")
    if kind != "function":
        raise _unsupported(
            f"Tools of type '{kind}' are not supported by this gateway: built-in tools run "
            "on OpenAI's servers; declare a function tool and run it in your agent.",
            f"{where}.type",
            code="unsupported_tool",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise errors.invalid_request(
            f"Missing required parameter: '{where}.name'.",
            param=f"{where}.name",
            code="missing_required_parameter",
        )
    function = {
        k: tool[k]
        for k in ("name", "description", "parameters", "strict")
        if tool.get(k) is not None
    }
    if not isinstance(function.get("parameters", {}), dict):
        raise errors.invalid_request(
            f"Invalid value for '{where}.parameters': expected a JSON schema object.",
            param=f"{where}.parameters",
        )
    return {"type": "function", "function": function}


def chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise errors.invalid_request(
                "Invalid value for 'tool_choice': expected auto, none, required or a function.",
                param="tool_choice",
            )
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _unsupported(
        f"tool_choice of type '{choice.get('type')}' is not supported by this gateway: name a "
        'function ({"type": "function", "name": ...}) or use auto, none or required.',
        "tool_choice",
        code="unsupported_tool",
    )


def chat_response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema" and isinstance(fmt.get("schema"), dict):
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        schema.setdefault("name", "response")
        return {"type": "json_schema", "json_schema": schema}
    raise errors.invalid_request(
        "Invalid value for 'text.format': expected text, json_object, or json_schema with a "
        "'schema'.",
        param="text.format",
    )


def _unsupported(message: str, param: str, *, code: str = "unsupported_parameter"):
    return errors.invalid_request(message, param=param, code=code)


def _no_response(response_id: str) -> errors.ForgeError:
    return errors.ForgeError(
        404,
        f"No response found with id '{response_id}'.",
        type="invalid_request_error",
        code="not_found",
        param="response_id",
    )
