"""What the simulated engine does with ``stop`` and ``response_format``, as vLLM's serving layer
does over its sampler: so a client (or the eval gate) that relies on them sees the same on the
laptop as on the cluster.

- ``stop`` (a string or a list of up to 4): the answer ends *before* the first stop string, with
  ``finish_reason: "stop"`` and, as vLLM adds, ``stop_reason``: the stop string (null when the
  answer ended otherwise); text that might begin a stop string is held back until it cannot.
- ``response_format`` ``json_object``: the generated words become ``{"answer": "<words>"}``;
  ``json_schema``: an object with every property of the schema's top level, the first string
  property carrying the words and the others a value of their type (string "", number 0,
  integer 0, boolean false, array [], object {}, null). Valid JSON whenever the generation ends
  on its own; cut by ``max_tokens`` (``finish_reason: "length"``) it is unfinished, as a real
  model's is.

Token counts are the engine's: the wrapping costs no tokens, as guided decoding's grammar
tokens are not separate in this model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list):
        return tuple(s for s in stop if isinstance(s, str) and s)
    return ()


class StopMatcher:
    """Feeds text through and says when a stop string appeared (streaming-safe)."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the answer

    def feed(self, text: str) -> tuple[str, bool]:
        """The text that may go out now, and whether a stop string ended the answer."""
        if not self.stops:
            return text, False
        held = self._held + text
        found = [(i, s) for s in self.stops if (i := held.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda hit: hit[0])  # the first in the text
            self._held = ""
            return held[:cut], True
        keep = max((_prefix_overlap(held, s) for s in self.stops), default=0)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def flush(self) -> str:
        """What was held back when the answer ends without a stop string."""
        held, self._held = self._held, ""
        return held


def _prefix_overlap(text: str, stop: str) -> int:
    """The longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


class JsonShape:
    """The opening and closing text around the generated words in JSON mode."""

    def __init__(self, opening: str, closing: str) -> None:
        self.opening = opening
        self.closing = closing

    @classmethod
    def of(cls, body: dict) -> JsonShape | None:
        spec = body.get("response_format")
        if not isinstance(spec, dict):
            return None
        kind = spec.get("type")
        if kind == "json_object":
            return cls('{"answer": "', '"}')
        if kind != "json_schema":
            return None
        schema = (spec.get("json_schema") or {}).get("schema") or {}
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict) or not properties:
            return cls('{"answer": "', '"}')
        names = list(properties)
        text_field = next(
            (n for n in names if _type_of(properties[n]) == "string"),
            None,
        )
        if text_field is None:
            return cls(json.dumps({n: _value_of(properties[n]) for n in names}), "")
        before = {n: _value_of(properties[n]) for n in names[: names.index(text_field)]}
        after = {n: _value_of(properties[n]) for n in names[names.index(text_field) + 1 :]}
        opening = "{" + "".join(f"{json.dumps(k)}: {json.dumps(v)}, " for k, v in before.items())
        opening += json.dumps(text_field) + ': "'
        closing = '"' + "".join(f", {json.dumps(k)}: {json.dumps(v)}" for k, v in after.items())
        return cls(opening, closing + "}")

    @staticmethod
    def escape(text: str) -> str:
        """Words as the inside of a JSON string."""
        return json.dumps(text)[1:-1]


def _type_of(schema: Any) -> str | None:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


_DEFAULTS: dict[str | None, Any] = {
    "string": "",
    "number": 0,
    "integer": 0,
    "boolean": False,
    "array": [],
    "object": {},
}


def _value_of(schema: Any) -> Any:
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    return _DEFAULTS.get(_type_of(schema))
