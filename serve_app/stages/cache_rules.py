"""The response cache's rules: which requests may be answered from it, under which key, and how
a stored answer is rendered again as JSON or as an SSE stream.

Only deterministic requests are cached: ``temperature`` explicitly 0, one choice, no tools, no
log probabilities. The key is a SHA-256 over a canonical JSON of the scope (the tenant, or
"shared" for tenants that opted in), the served model, the engine's identity (weights and
revision: a new model never replays the old one's answers), the route, and every body field
except those that cannot change the output (``stream``, ``stream_options``, ``user``): unknown
fields are keyed, not ignored, so a new sampling parameter can only cause a miss, never a wrong
hit. ``seed`` is part of the key like any other field.

What is stored is the canonical completion (text, finish reason, usage), not a response: one
entry answers both a streamed and a non-streamed repeat, each in the shape the client asked for.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from serve_app import sse

# Body fields that do not change what the model says.
_NOT_KEYED = frozenset({"stream", "stream_options", "user"})
# Fields whose presence makes an answer non-deterministic or not replayable.
_TOOLS = ("tools", "tool_choice", "functions", "function_call")
_FORMAT = 1  # bump when the entry's shape changes: old entries then miss


def bypass_reason(body: dict, cache_control: str | None) -> str | None:
    """Why this request must not be served from (or stored in) the cache, or None."""
    if cache_control:
        directives = {d.strip().lower() for d in cache_control.split(",")}
        if directives & {"no-cache", "no-store"}:
            return "client"
    temperature = body.get("temperature")
    if isinstance(temperature, bool) or temperature != 0:
        return "sampling"  # absent means 1 (OpenAI's default): random, not cached
    if body.get("n", 1) != 1:
        return "sampling"
    if any(body.get(name) not in (None, []) for name in _TOOLS):
        return "tools"
    # Any integer asks for log probabilities on /v1/completions, 0 included (the chosen
    # token's); chat's top_logprobs means nothing unless logprobs is true.
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:  # not `in`: 0 == False
        return "logprobs"
    return None


def cache_key(scope: str, model: str, engine_identity: str, route: str, body: dict) -> str:
    keyed = {k: v for k, v in body.items() if k not in _NOT_KEYED}
    canonical = orjson.dumps(
        [_FORMAT, scope, model, engine_identity, route, keyed], option=orjson.OPT_SORT_KEYS
    )
    return "cache:" + hashlib.sha256(canonical).hexdigest()


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    route: str  # "chat" or "completion"
    model: str
    text: str
    finish_reason: str
    usage: dict

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "v": _FORMAT,
                "route": self.route,
                "model": self.model,
                "text": self.text,
                "finish_reason": self.finish_reason,
                "usage": self.usage,
            }
        )

    @classmethod
    def decode(cls, raw: bytes) -> CachedAnswer | None:
        """None for anything that is not a current entry (a stale format, a damaged value)."""
        try:
            data = orjson.loads(raw)
            if data.get("v") != _FORMAT:
                return None
            return cls(
                data["route"], data["model"], data["text"], data["finish_reason"], data["usage"]
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            return None

    # -- from a backend's answer -------------------------------------------------------------

    @classmethod
    def from_response(cls, route: str, response: dict) -> CachedAnswer | None:
        """From a non-streamed OpenAI response; None unless it is one plain finished choice."""
        try:
            (choice,) = response["choices"]
            if route == "chat":
                message = choice["message"]
                if message.get("tool_calls") or message.get("function_call"):
                    return None
                text = message["content"]
            else:
                text = choice["text"]
            finish = choice["finish_reason"]
            usage = response["usage"]
        except (KeyError, TypeError, ValueError):
            return None
        if not isinstance(text, str) or finish not in ("stop", "length") or not usage:
            return None
        return cls(route, response.get("model", ""), text, finish, usage)

    @classmethod
    def from_frames(
        cls, route: str, model: str, frames: Iterable[bytes], usage: dict | None
    ) -> CachedAnswer | None:
        """From a completed stream's SSE frames; None unless it finished plainly."""
        pieces: list[str] = []
        finish = None
        try:
            for frame in frames:
                if not frame.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(frame[6:])
                for choice in chunk.get("choices") or ():
                    if route == "chat":
                        delta = choice.get("delta") or {}
                        if delta.get("tool_calls") or delta.get("function_call"):
                            return None
                        text = delta.get("content")
                    else:
                        text = choice.get("text")
                    if text:
                        pieces.append(text)
                    finish = choice.get("finish_reason") or finish
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            return None
        if finish not in ("stop", "length") or not usage:
            return None
        return cls(route, model, "".join(pieces), finish, usage)

    # -- to the client -----------------------------------------------------------------------

    def response(self, request_id: str) -> dict:
        """The OpenAI response body, as the backend would have sent it."""
        created = int(time.time())
        if self.route == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text},
                "logprobs": None,
                "finish_reason": self.finish_reason,
            }
            obj, prefix = "chat.completion", "chatcmpl-"
        else:
            choice = {
                "index": 0,
                "text": self.text,
                "logprobs": None,
                "finish_reason": self.finish_reason,
            }
            obj, prefix = "text_completion", "cmpl-"
        return {
            "id": prefix + request_id,
            "object": obj,
            "created": created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }

    def frames(self, request_id: str, include_usage: bool) -> list[bytes]:
        """The stream a backend would have sent, in three chunks (role, text, finish), the usage
        chunk when asked for, and ``[DONE]``."""
        created = int(time.time())
        if self.route == "chat":
            envelope = {"id": "chatcmpl-" + request_id, "object": "chat.completion.chunk"}
            role: list[dict] = [{"role": "assistant", "content": ""}]
            body = [{"content": self.text}, {}]
        else:
            envelope = {"id": "cmpl-" + request_id, "object": "text_completion"}
            role, body = [], [self.text, ""]
        envelope |= {"created": created, "model": self.model}
        extra = {"usage": None} if include_usage else {}
        chunks = []
        for i, part in enumerate([*role, *body]):
            last = i == len(role) + len(body) - 1
            if self.route == "chat":
                choice = {"index": 0, "delta": part, "logprobs": None}
            else:
                choice = {"index": 0, "text": part, "logprobs": None}
            choice["finish_reason"] = self.finish_reason if last else None
            chunks.append({**envelope, "choices": [choice], **extra})
        if include_usage:
            chunks.append({**envelope, "choices": [], "usage": self.usage})
        return [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [sse.DONE]
