"""A value that validates against a JSON schema, as the simulated model fills one: a tool call's
arguments, a structured output. vLLM's guided decoding makes every answer fit the schema; the
simulator must too, for the schemas clients send: pydantic's (``$ref`` into ``$defs`` for a nested
model, ``anyOf`` with null for an ``Optional``, ``format`` for a date or a UUID), zod's, and
hand-written ones.

Strings come from the caller (the words the model says); formats a string cannot carry get a
valid example instead; numbers keep to ``minimum``; arrays have their ``minItems``. A recursive
schema stops at a depth past which it takes the smallest value its schema allows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

_MAX_DEPTH = 8
# A string of a format is that format's example, not the model's words (pydantic checks them).
_FORMATS = {
    "date-time": "1970-01-01T00:00:00Z",
    "date": "1970-01-01",
    "time": "00:00:00Z",
    "duration": "PT0S",
    "email": "user@example.com",
    "uri": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "00000000-0000-4000-8000-000000000000",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
}


class SchemaValues:
    """Fills schemas: ``words()`` for each plain string; ``scalars``, the number, integer and
    boolean where the schema leaves the value open."""

    def __init__(self, words: Callable[[], str], scalars: Mapping[str, Any]) -> None:
        self.words = words
        self.scalars = scalars

    def value(self, schema: Any, root: Any = None, depth: int = 0) -> Any:
        if not isinstance(schema, dict):
            return self.words()  # ``true`` or no schema: anything goes
        root = schema if root is None else root
        if "$ref" in schema:
            target = _resolve(root, schema["$ref"])
            if target is None or depth >= _MAX_DEPTH:
                return None
            return self.value(target, root, depth + 1)
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return schema["enum"][0]
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                # The first branch that is not null: an Optional gets its value, not None.
                chosen = next((b for b in branches if _type_of(b) != "null"), branches[0])
                return self.value(chosen, root, depth + 1)
        if isinstance(schema.get("allOf"), list):
            return self.value(_merged(schema, root), root, depth + 1)
        kind = _type_of(schema)
        if kind is None and ("properties" in schema or "required" in schema):
            kind = "object"
        if kind == "object":
            return self._object(schema, root, depth)
        if kind == "array":
            count = schema.get("minItems") if isinstance(schema.get("minItems"), int) else 0
            items = schema.get("items")
            if depth >= _MAX_DEPTH:
                return []
            return [self.value(items, root, depth + 1) for _ in range(count)]
        if kind == "string":
            return self._string(schema)
        if kind in ("integer", "number"):
            return _number(schema, kind, self.scalars[kind])
        if kind == "boolean":
            return self.scalars["boolean"]
        if kind == "null":
            return None
        return self.words()

    def arguments(self, schema: Any) -> dict:
        """A tool's arguments: always an object, whatever its ``parameters`` say."""
        found = self.value(schema) if isinstance(schema, dict) and schema else {}
        return found if isinstance(found, dict) else {}

    def _object(self, schema: dict, root: Any, depth: int) -> dict:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else None
        names = required if required is not None else list(properties)
        if depth >= _MAX_DEPTH:
            names = required or []
        return {n: self.value(properties.get(n, {}), root, depth + 1) for n in names}

    def _string(self, schema: dict) -> str:
        example = _FORMATS.get(schema.get("format"))  # type: ignore[arg-type]
        if example is not None:
            return example
        text = self.words()
        most = schema.get("maxLength")
        if isinstance(most, int) and len(text) > most:
            text = text[:most]
        least = schema.get("minLength")
        if isinstance(least, int) and len(text) < least:
            text += "x" * (least - len(text))
        return text


def _type_of(schema: Any) -> str | None:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null" if "null" in kind else None)
    return kind if isinstance(kind, str) else None


def _resolve(root: Any, ref: Any) -> Any:
    """A local ``$ref`` (``#/$defs/Name``, ``#/definitions/Name``, ``#``); None for another."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _merged(schema: dict, root: Any) -> dict:
    """An ``allOf`` as one schema: its parts' properties and required names together."""
    merged: dict = {k: v for k, v in schema.items() if k != "allOf"}
    for part in schema["allOf"]:
        if isinstance(part, dict) and "$ref" in part:
            part = _resolve(root, part["$ref"])
        if not isinstance(part, dict):
            continue
        for key, value in part.items():
            if key == "properties" and isinstance(value, dict):
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required" and isinstance(value, list):
                merged["required"] = [*merged.get("required", []), *value]
            else:
                merged.setdefault(key, value)
    return merged


def _number(schema: dict, kind: str, default: Any) -> int | float:
    low, high = schema.get("minimum"), schema.get("maximum")
    above = schema.get("exclusiveMinimum")
    if isinstance(low, int | float) and not isinstance(low, bool):
        value = low
    elif isinstance(above, int | float) and not isinstance(above, bool):
        value = above + 1
    elif isinstance(high, int | float) and not isinstance(high, bool) and default > high:
        value = high
    else:
        value = default
    return int(value) if kind == "integer" else float(value)
