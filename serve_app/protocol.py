"""OpenAI wire types: what the gateway validates on the way in.

The models validate what Forge relies on (model, messages or prompt, token limits, streaming
options, sampling ranges) and allow every other OpenAI field through untouched, so new SDK
parameters reach the backends without a gateway release. Numbers and flags are strict, as
OpenAI's schema types them: ``"max_tokens": true`` or ``"16"`` is a 400, not a silent 1 or 16
(a backend given the raw body would read it differently from the quota that priced it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)

from serve_app import errors, tokenizer

# Where a chat message or delta carries the model's reasoning: vLLM's reasoning parser writes
# ``reasoning``; ``reasoning_content`` is its name before vLLM 0.11 and on other servers'
# (DeepSeek's API, SGLang, llama.cpp).
REASONING_FIELDS = ("reasoning", "reasoning_content")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


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
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, strict=True)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1, strict=True)] | None = None
    n: Annotated[int, Field(ge=1, le=1, strict=True)] = 1
    seed: Annotated[int, Field(strict=True)] | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def output_limit(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, strict=True)] | None = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingRequest):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]


_MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on one request's batch


class EmbeddingRequest(BaseModel):
    """``/v1/embeddings``: one input or a batch, as text or as token ids (OpenAI's four forms)."""

    model_config = ConfigDict(extra="allow")

    model: Annotated[str, Field(min_length=1)]
    input: Annotated[
        Any,
        Field(description="A string, up to 2048 strings, token ids, or up to 2048 token-id arrays"),
    ]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, strict=True)] | None = None
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _one_of_openai_forms(cls, value: Any) -> Any:
        if _embedding_input(value):
            return value
        raise ValueError(
            "expected a non-empty string, an array of up to 2048 non-empty strings, an array of "
            "token ids, or an array of up to 2048 non-empty token-id arrays"
        )

    # What the stages ask of every inference request: an embedding never streams or generates.
    @property
    def stream(self) -> bool:
        return False

    @property
    def include_usage(self) -> bool:
        return False

    def output_limit(self) -> int:
        return 0


def _embedding_input(value: Any) -> bool:
    def ids(item: Any) -> bool:
        return (
            isinstance(item, list)
            and bool(item)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in item)
        )

    if isinstance(value, str):
        return bool(value)
    if not isinstance(value, list) or not 0 < len(value) <= _MAX_EMBEDDING_INPUTS:
        return ids(value)
    if all(isinstance(item, str) and item for item in value):
        return True
    return ids(value) or all(ids(item) for item in value)


M = TypeVar("M", bound=BaseModel)
RequestModel = type[ChatCompletionRequest] | type[CompletionRequest] | type[EmbeddingRequest]


def parse_request(raw: bytes, model: RequestModel) -> tuple[dict, _SamplingRequest]:
    """Parse and validate a request body; return the raw dict (to forward) and the model.

    Raises a 400 ``ForgeError`` that names the offending field.
    """
    body = load_object(raw)
    for name in _NULL_IS_DEFAULT:
        if name in body and body[name] is None:
            del body[name]  # OpenAI's API takes null for its default; not every backend does
    return body, validate(body, model)


# The fields OpenAI's API takes as null that the models here hold to their default's type.
_NULL_IS_DEFAULT = ("stream", "n")


def load_object(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 that says why it is not one."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise errors.invalid_request(
            f"Request body is not valid JSON: {exc.msg}.", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise errors.invalid_request("Request body must be a JSON object.", code="invalid_json")
    return body


def validate(body: dict, model: type[M]) -> M:
    """``body`` as ``model``, or a 400 that names the offending field as the client wrote it."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = _param(first["loc"], body)
        if first["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
            code = "missing_required_parameter"
        else:
            message = f"Invalid value for '{param}': {first['msg'].removeprefix('Value error, ')}."
            code = "invalid_value"
        if param == "n":
            message = "Only n=1 is supported."
        elif param is not None and param.split(".")[0] == "prompt" and model is CompletionRequest:
            # Not pydantic's "valid string" for a batch of prompts (LangChain's OpenAI LLM
            # sends its batches so) or token ids: what is taken, and what to do instead.
            message = (
                "Invalid value for 'prompt': this gateway takes one text prompt per request "
                "(a string, or a list of one string); send each prompt in its own request."
            )
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


def embedding_inputs(body: dict) -> list[str | list[int]]:
    """The inputs of an embeddings body, as a batch (a lone string or token list is one)."""
    value = body["input"]
    if isinstance(value, str) or (value and isinstance(value[0], int)):
        return [value]
    return list(value)


def count_prompt_tokens(body: dict, kind: str) -> int:
    """The gateway's count of what the model reads: the quota's reservation and the estimate
    metering falls back on. Token-id inputs count as themselves."""
    if kind == "embedding":
        return sum(
            len(item) if isinstance(item, list) else tokenizer.count_tokens(item)
            for item in embedding_inputs(body)
        )
    return tokenizer.count_tokens(prompt_text(body, kind))


def prompt_text(body: dict, kind: str) -> str:
    """The text the model sees: the rendered chat, or the completion prompt."""
    if kind == "chat":
        tools = body.get("tools")
        return tokenizer.render_chat(
            body["messages"],
            tools if isinstance(tools, list) else None,
            continue_final=body.get("continue_final_message") is True,
        )
    prompt = body["prompt"]
    return prompt if isinstance(prompt, str) else prompt[0]
