"""Requests that carry marker strings into the prompt and into the answer, for the tests that
look for them where they must not be (``gateway/test_span_hygiene.py``: spans and log records in
process; ``tests/e2e/test_log_hygiene.py``: every log file Ray wrote and every metric)."""

from __future__ import annotations


def marked(prompt_mark: str, answer_mark: str) -> tuple[list[dict], dict, dict]:
    """A chat carrying ``prompt_mark``; a JSON-schema ``response_format`` and a tool whose
    answers carry ``answer_mark`` (the simulated model fills an untyped property from its enum,
    and a tool's argument from its enum): (messages, response_format, tool)."""
    messages = [{"role": "user", "content": f"Please look up {prompt_mark}"}]
    tagged = {
        "type": "json_schema",
        "json_schema": {
            "name": "tagged",
            "schema": {
                "type": "object",
                "properties": {"tag": {"enum": [answer_mark]}, "answer": {"type": "string"}},
                "required": ["tag", "answer"],
            },
        },
    }
    lookup = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "enum": [answer_mark]}},
                "required": ["code"],
            },
        },
    }
    return messages, tagged, lookup
