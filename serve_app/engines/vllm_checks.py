"""vLLM's own checks of a request's sampling and tool fields, for the simulated engine: a request
vLLM would refuse is refused on the laptop too, with vLLM's words, so a client's mistake shows
where it is written, not first on the cluster.

The types are vLLM 0.32's request models' (``tools``, ``tool_choice``, ``response_format``,
``stop``, ``logprobs``, ``top_logprobs``, ``reasoning_effort``), and so are the cross-field
rules and their messages (``check_tool_usage``, ``check_logprobs``); a type error names the field
as the client wrote it (``protocol.validate``). Fields vLLM takes and the simulator does not act
on pass.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from serve_app import errors, protocol
from serve_app.engines.base import Kind


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Function(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(_Open):
    type: Literal["function"] = "function"
    function: _Function


class _NamedFunction(_Open):
    name: str


class _NamedToolChoice(_Open):
    function: _NamedFunction
    type: Literal["function"] = "function"


class _JsonSchema(_Open):
    name: str
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")


class _ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: _JsonSchema | None = None


class _Sampling(_Open):
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    response_format: _ResponseFormat | None = None


class _Chat(_Sampling):
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedToolChoice | None = None
    top_logprobs: int | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )


class _Completion(_Sampling):
    logprobs: int | None = None  # the legacy API's: how many alternatives per token
    echo: bool | None = None
    suffix: str | None = None


def check_request(body: dict, kind: Kind) -> None:
    """A 400 for what vLLM's serving layer would refuse in ``body``; nothing otherwise."""
    if kind == "chat":
        _tool_usage(body)
        _logprobs(body)
    protocol.validate(body, _Chat if kind == "chat" else _Completion)


def _tool_usage(body: dict) -> None:
    """vLLM's ``check_tool_usage``, in its words."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools == []:
        raise errors.invalid_request(
            "`tools` must not be an empty array. Either provide at least one tool or omit the "
            "field entirely.",
            param="tools",
        )
    if choice is None or choice == "none":
        return
    if tools is None:
        raise errors.invalid_request(
            "When using `tool_choice`, `tools` must be set.", param="tool_choice"
        )
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        raise errors.invalid_request(
            f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" '
            'or "required" are supported.',
            param="tool_choice",
        )
    if isinstance(choice, dict):
        usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
        function = choice.get("function")
        if not isinstance(function, dict):
            raise errors.invalid_request(
                f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}",
                param="tool_choice.function",
            )
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise errors.invalid_request(
                f"Invalid `name` in `function`: `{name}` in `tool_choice`! {usage}",
                param="tool_choice.function.name",
            )
        names = [(t.get("function") or {}).get("name") for t in tools or () if isinstance(t, dict)]
        if name not in names:
            raise errors.invalid_request(
                "The tool specified in `tool_choice` does not match any of the specified `tools`",
                param="tool_choice",
            )


def _logprobs(body: dict) -> None:
    """vLLM's ``check_logprobs`` for ``top_logprobs``, in its words."""
    top = body.get("top_logprobs")
    if top is None:
        return
    if not isinstance(top, int | float) or isinstance(top, bool):
        raise errors.invalid_request("`top_logprobs` must be an integer.", param="top_logprobs")
    if top < 0 and top != -1:
        raise errors.invalid_request(
            "`top_logprobs` must be a positive value or -1.", param="top_logprobs"
        )
    if (top == -1 or top > 0) and not body.get("logprobs"):
        raise errors.invalid_request(
            "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs"
        )
