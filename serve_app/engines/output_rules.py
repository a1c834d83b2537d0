"""What the simulated engine does with ``stop`` and ``response_format``, as vLLM's serving layer
does over its sampler: so a client (or the eval gate) that relies on them sees the same on the
laptop as on the cluster.

- ``stop`` (a string or a list of up to 4): the answer ends *before* the first stop string, with
  ``finish_reason: "stop"`` and, as vLLM adds, ``stop_reason``: the stop string (null when the
  answer ended otherwise); text that might begin a stop string is held back until it cannot.
- ``response_format`` ``json_object``: the generated words become ``{"answer": "<words>"}``;
  ``json_schema``: a value that validates against the schema (``schema_values.py``: nested
  models, ``$ref``, ``anyOf``, formats), the first string in it carrying the words and the
  others empty (numbers 0 or their minimum, booleans false); with no string anywhere the words
  are not said and the value comes whole at the end. Valid whenever the generation ends on its
  own; cut by ``max_tokens`` (``finish_reason: "length"``) it is unfinished, as a real model's
  is.

Token counts are the engine's: the wrapping costs no tokens, as guided decoding's grammar
tokens are not separate in this model.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from serve_app.engines.schema_values import SchemaValues


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
    """The opening and closing text around the generated words in JSON mode; ``words`` False
    where the schema has no string to carry them (the object comes whole at the end)."""

    def __init__(self, opening: str, closing: str, words: bool = True) -> None:
        self.opening = opening
        self.closing = closing
        self.words = words

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
        schema = (spec.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict) or not schema:
            return cls('{"answer": "', '"}')
        slots = iter([_SLOT])  # the first string says the words, any other is empty
        value = SchemaValues(lambda: next(slots, ""), _SCALARS).value(schema)
        text = json.dumps(value)
        slot = json.dumps(_SLOT)
        if slot not in text:
            return cls("", text, words=False)
        opening, closing = text.split(slot, 1)
        return cls(opening + '"', '"' + closing)

    def escape(self, text: str) -> str:
        """Words as the inside of a JSON string (none where nothing carries them)."""
        return json.dumps(text)[1:-1] if self.words else ""


_SLOT = "\x00forge-words\x00"  # where the words go: no schema value or format example has it
_SCALARS = {"integer": 0, "number": 0, "boolean": False}
