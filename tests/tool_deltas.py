"""Tool-call deltas of a streamed chat completion put back together, as the openai client's
stream helper does: by index, the id and name once, the arguments concatenated piece by piece."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamedCalls:
    calls: dict[int, dict] = field(default_factory=dict)  # index → {"id", "name", "arguments"}
    finish: str | None = None
    usage: Any = None
    deltas: int = 0  # tool-call deltas received: >1 means the arguments came in pieces


def assemble(chunks: Iterable[Any]) -> StreamedCalls:
    """The calls of a stream's chunks (``ChatCompletionChunk``s; for an async stream, pass
    ``[c async for c in stream]``). A name sent twice for one call is a protocol error."""
    out = StreamedCalls()
    for chunk in chunks:
        out.usage = chunk.usage or out.usage
        for choice in chunk.choices:
            out.finish = choice.finish_reason or out.finish
            for delta in choice.delta.tool_calls or ():
                out.deltas += 1
                entry = out.calls.setdefault(
                    delta.index, {"id": None, "name": None, "arguments": ""}
                )
                entry["id"] = delta.id or entry["id"]
                function = delta.function
                if function is not None and function.name:
                    assert entry["name"] is None, "a call's name arrives once"
                    entry["name"] = function.name
                entry["arguments"] += (function and function.arguments) or ""
    return out
