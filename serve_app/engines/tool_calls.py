"""What the simulated model does with ``tools``: a deterministic rule agent authors can predict,
so an agent that works on the laptop is exercised the way a real model would drive it.

The rule, for a chat request with ``tools``:

- ``tool_choice: "none"``, or no tools: a plain text answer.
- ``tool_choice: {"type": "function", "function": {"name": N}}``: a call of N (a 400 if N is not
  among the tools).
- ``"auto"`` (the default): once the results of the last assistant message's calls are in (``tool``
  messages after it, whatever text follows them), the final text answer. Otherwise a call of
  every tool the last user message names (case-insensitive:
  its name, or the words of its name after the first, so ``get_service_status`` is named by
  "service status" and ``open_ticket`` by "ticket"), in the order of ``tools``; one call only
  when ``parallel_tool_calls`` is false; a text answer when it names none.
- ``"required"``: as ``auto``, but always a call: of the named tools, else of the first tool;
  once results are in, of the first tool not just called (so a loop ends on a final tool, as
  pydantic-ai's ``final_result``).

Arguments fill the tool's ``parameters`` schema (``schema_values.py``: its ``required``
properties, or all of them if it lists none; nested models through ``$ref``, the first
non-null branch of an ``anyOf``): an enum's first value; a string is the last word of the last
user message that is not a tool's name (``"value"`` if none), or its format's example; an
integer or number its ``minimum`` (else 1); a boolean ``true``; an array its ``minItems``. Each
call's arguments are one JSON object that validates against the schema, streamed token by token
as OpenAI tool-call deltas.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

from serve_app import errors
from serve_app.engines.schema_values import SchemaValues

_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]*")
_SCALARS = {"integer": 1, "number": 1, "boolean": True}


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
        answered = _answered_calls(messages)
        if answered is not None:  # the results of the model's last calls are in
            if choice == "auto":
                return []  # answer
            # Required: a tool not just called (pydantic-ai's final_result after its tools),
            # rather than the same call for ever.
            chosen = [next((n for n in by_name if n not in answered), next(iter(by_name)))]
        else:
            chosen = [n for n in by_name if _mentions(said, n)]
        if not chosen and choice == "required":
            chosen = [next(iter(by_name))]
        if body.get("parallel_tool_calls") is False:
            chosen = chosen[:1]
    subject = _subject(said, by_name)
    values = SchemaValues(lambda: subject, _SCALARS)
    return [
        ToolCall(
            id=f"call_{zlib.crc32(f'{request_id}:{i}'.encode()):08x}",
            name=name,
            arguments=json.dumps(values.arguments(by_name[name].get("parameters"))),
        )
        for i, name in enumerate(chosen)
    ]


def _answered_calls(messages: list[dict]) -> set[str] | None:
    """The names the last assistant message called, when their results follow it (a tool
    message; a client's note after them, as Claude Code adds, changes nothing); else None."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") != "assistant":
            continue
        calls = messages[i].get("tool_calls") or []
        if not calls or not any(m.get("role") == "tool" for m in messages[i + 1 :]):
            return None
        return {(c.get("function") or {}).get("name") for c in calls if isinstance(c, dict)}
    return None


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
