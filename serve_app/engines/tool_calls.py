"""What the simulated model does with ``tools``: a deterministic rule agent authors can predict,
so an agent that works on the laptop is exercised the way a real model would drive it.

The rule, for a chat request with ``tools``:

- ``tool_choice: "none"``, or no tools: a plain text answer.
- ``tool_choice: {"type": "function", "function": {"name": N}}``: a call of N (a 400 if N is not
  among the tools).
- ``"auto"`` (the default): if the conversation ends with a tool result (a ``tool`` message), the
  final text answer. Otherwise a call of every tool the last user message names (case-insensitive:
  its name, or the words of its name after the first, so ``get_service_status`` is named by
  "service status" and ``open_ticket`` by "ticket"), in the order of ``tools``; one call only
  when ``parallel_tool_calls`` is false; a text answer when it names none.
- ``"required"``: as ``auto``, but always a call: of the named tools, else of the first tool.

Arguments fill the tool's ``parameters`` schema (its ``required`` properties, or all of them if it
lists none): an enum's first value; a string is the last word of the last user message that is
not a tool's name (``"value"`` if none); an integer or number its ``minimum`` (else 1); a
boolean ``true``; an array ``[]``; an object ``{}``. Each call's arguments are one JSON object
that validates against such a schema, streamed token by token as OpenAI tool-call deltas.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

from serve_app import errors

_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


def plan_tool_calls(body: dict, request_id: str) -> list[ToolCall]:
    """The calls the simulated model makes for this request; [] for a text answer."""
    tools = [t for t in body.get("tools") or () if isinstance(t, dict) and t.get("function")]
    choice = body.get("tool_choice", "auto")
    if not tools or choice == "none":
        return []
    by_name = {t["function"].get("name"): t["function"] for t in tools}
    messages = body.get("messages") or []
    said = _last_user_text(messages)
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if name not in by_name:
            raise errors.invalid_request(
                f"tool_choice names the function {name!r}, which is not in 'tools'.",
                param="tool_choice",
            )
        chosen = [name]
    else:
        if choice == "auto" and messages and messages[-1].get("role") == "tool":
            return []  # a tool result is in: answer
        chosen = [n for n in by_name if _mentions(said, n)]
        if not chosen and choice == "required":
            chosen = [next(iter(by_name))]
        if body.get("parallel_tool_calls") is False:
            chosen = chosen[:1]
    subject = _subject(said, by_name)
    return [
        ToolCall(
            id=f"call_{zlib.crc32(f'{request_id}:{i}'.encode()):08x}",
            name=name,
            arguments=json.dumps(_arguments(by_name[name].get("parameters") or {}, subject)),
        )
        for i, name in enumerate(chosen)
    ]


def _last_user_text(messages: list[dict]) -> str:
    for message in reversed(messages):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return " ".join(p.get("text") or "" for p in content if isinstance(p, dict))
            return content or ""
    return ""


def _mentions(text: str, name: str) -> bool:
    text = text.lower()
    words = name.lower().split("_")
    tail = " ".join(words[1:]) if len(words) > 1 else words[0]
    return name.lower() in text or tail in text


def _subject(text: str, tools: dict[str, Any]) -> str:
    names = {w.lower() for n in tools for w in [n, *n.split("_")]}
    words = [w for w in _WORD.findall(text) if w.lower() not in names]
    return words[-1] if words else "value"


def _arguments(schema: dict, subject: str) -> dict:
    properties = schema.get("properties") or {}
    wanted = schema.get("required") or list(properties)
    return {name: _value(properties.get(name) or {}, subject) for name in wanted}


def _value(schema: dict, subject: str) -> Any:
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    if kind == "string":
        return subject
    if kind in ("integer", "number"):
        low = schema.get("minimum", 1)
        return int(low) if kind == "integer" else float(low)
    if kind == "boolean":
        return True
    if kind == "array":
        return []
    if kind == "object":
        return _arguments(schema, subject)
    return subject
