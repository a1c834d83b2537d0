"""What Gemini's OpenAI-compatible endpoint does differently from OpenAI's API around tool
calls, mended in the fallback so that a failover does not break an agent.

- **Its stream's tool-call deltas carry no ``index``** (OpenAI's clients need one: the ``openai``
  SDK's stream helper refuses such a delta, and a reader that defaults it to 0 merges parallel
  calls into one with both calls' arguments). ``ToolCallIndexes`` gives each call its index:
  a delta naming an id other than the last call's opens the next call, any other continues it.
- **Gemini 3 refuses a function call of the current turn without its thought signature**
  (``extra_content.google.thought_signature``; "a required thought signature not returned ...
  400", https://ai.google.dev/gemini-api/docs/thought-signatures). A call the primary made (vLLM
  signs nothing) or one a dialect rebuilt has none, so an agent's tool loop failed over in the
  middle of a turn would be refused. ``signed`` gives such a call the placeholder Google
  documents for calls another model made; a call Gemini made keeps its own signature.
"""

from __future__ import annotations

from typing import Any

import orjson

from serve_app import sse

# Google's placeholder for a call without a signature of Gemini's own (its thought-signatures
# guide, for conversations carried over from another model or calls injected by a client).
PLACEHOLDER_SIGNATURE = "skip_thought_signature_validator"


def unsigned_steps(messages: list[Any]) -> list[int]:
    """The positions of the current turn's (after the last user message) assistant messages
    with tool calls, none of them signed: what Gemini 3 refuses."""
    last_user = max((i for i, m in enumerate(messages) if _role(m) == "user"), default=-1)
    steps = []
    for i in range(last_user + 1, len(messages)):
        calls = messages[i].get("tool_calls") if _role(messages[i]) == "assistant" else None
        if isinstance(calls, list) and calls and isinstance(calls[0], dict):
            if not any(_signature(c) for c in calls):
                steps.append(i)
    return steps


def signed(messages: list[Any]) -> list[Any]:
    """``messages`` with the first call of each unsigned step signed with the placeholder.
    The messages that change are copies; the client's body is left as it was."""
    out = list(messages)
    google = {"thought_signature": PLACEHOLDER_SIGNATURE}
    for i in unsigned_steps(messages):
        first, *rest = out[i]["tool_calls"]
        out[i] = {**out[i], "tool_calls": [{**first, "extra_content": {"google": google}}, *rest]}
    return out


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def _signature(call: Any) -> Any:
    extra = call.get("extra_content") if isinstance(call, dict) else None
    google = extra.get("google") if isinstance(extra, dict) else None
    return google.get("thought_signature") if isinstance(google, dict) else None


class ToolCallIndexes:
    """One stream's tool-call deltas, each given the ``index`` its call has in the answer."""

    __slots__ = ("_ids", "_last")

    def __init__(self) -> None:
        self._ids: dict[int, str] = {}  # each call's id, by index
        self._last = -1

    def mend(self, event: bytes) -> bytes:
        """``event`` as it came, or re-encoded with an index on each tool-call delta that
        lacked one. Only an event that carries tool calls is decoded."""
        if b'"tool_calls"' not in event:
            return event
        try:
            payload = orjson.loads(sse.frame_data(event))
        except orjson.JSONDecodeError:
            return event
        if not isinstance(payload, dict):
            return event
        changed = False
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(delta, dict):
                continue
            for part in delta.get("tool_calls") or ():
                if isinstance(part, dict):
                    changed |= self._index(part)
        return sse.frame(payload) if changed else event

    def _index(self, part: dict) -> bool:
        """Give ``part`` its index; False if it had one."""
        call_id = part.get("id")
        index = part.get("index")
        if isinstance(index, int) and not isinstance(index, bool):
            self._last = max(self._last, index)
            if call_id:
                self._ids[index] = call_id
            return False
        if self._last < 0 or (call_id and call_id != self._ids.get(self._last)):
            self._last += 1
            if call_id:
                self._ids[self._last] = call_id
        part["index"] = self._last
        return True
