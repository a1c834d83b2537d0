"""OpenAI wire types: what the gateway validates on the way in.

The models validate what Forge relies on (model, messages or prompt, token limits, streaming
options, sampling ranges) and allow every other OpenAI field through untouched, so new SDK
parameters reach the backends without a gateway release.
"""

from __future__ import annotations

from typing import Annotated, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serve_app import errors, tokenizer


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Annotated[str, Field(min_length=1)]
    text: str | None = None

    @model_validator(mode="after")
    def _text_parts_have_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text content part needs a string 'text'")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1)]
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    seed: int | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def output_limit(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]


RequestModel = type[ChatCompletionRequest] | type[CompletionRequest]


def parse_request(raw: bytes, model: RequestModel) -> tuple[dict, _SamplingRequest]:
    """Parse and validate a request body; return the raw dict (to forward) and the model.

    Raises a 400 ``ForgeError`` that names the offending field.
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise errors.invalid_request(
            f"Request body is not valid JSON: {exc.msg}.", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise errors.invalid_request("Request body must be a JSON object.", code="invalid_json")
    try:
        return body, model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = _param(first["loc"], body)
        if first["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
            code = "missing_required_parameter"
        else:
            message = f"Invalid value for '{param}': {first['msg']}."
            code = "invalid_value"
        if param == "n":
            message = "Only n=1 is supported."
        raise errors.invalid_request(message, param=param, code=code) from None


def _param(loc: tuple, body: dict) -> str | None:
    """The field as the client wrote it. Pydantic adds union-member tags to the path
    (``prompt.str``) that are not fields, so stop where the path leaves the body; a missing
    last field is kept (``messages.0.role``)."""
    path, node = [], body
    for i, part in enumerate(loc):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        elif not (isinstance(node, dict) and i == len(loc) - 1):
            break
        path.append(str(part))
    return ".".join(path) or None


def prompt_text(body: dict, kind: str) -> str:
    """The text the model sees: the rendered chat, or the completion prompt."""
    if kind == "chat":
        tools = body.get("tools")
        return tokenizer.render_chat(body["messages"], tools if isinstance(tools, list) else None)
    prompt = body["prompt"]
    return prompt if isinstance(prompt, str) else prompt[0]
