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
A stream's answer is gathered as its frames pass (``StreamedAnswer``), its text only. An entry
in the shared scope also names the tenant that wrote it, the replica that served it and how
long that took, so another tenant can be answered exactly as a miss would have been
(``stages/cache.py``).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from serve_app import sse, tokenizer

# Body fields that do not change what the model says.
_NOT_KEYED = frozenset({"stream", "stream_options", "user"})
# Fields whose presence makes an answer non-deterministic or not replayable.
_TOOLS = ("tools", "tool_choice", "functions", "function_call")
_FORMAT = 2  # bump when the entry's shape changes: old entries then miss


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
class Provenance:
    """Who wrote a shared-scope entry and how the miss that wrote it was served: what a hit
    for another tenant needs to look like that miss (``stages/cache.py``)."""

    writer: str  # the tenant
    replica: str | None  # the replica that generated it
    ttft_s: float | None  # its time to first byte, for a stream (None: a JSON answer)
    duration_s: float  # until its last byte left the backend


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    route: str  # "chat" or "completion"
    model: str
    text: str
    finish_reason: str
    usage: dict
    provenance: Provenance | None = None  # a shared-scope entry's; None in a tenant's own
    # vLLM's ``stop_reason`` (the stop string that ended it, or null) where the backend said it,
    # so a hit reads as the miss did; ``()`` from a backend that does not say (the fallback).
    stop_reason: str | int | tuple[()] | None = ()

    def encode(self) -> bytes:
        entry: dict[str, Any] = {
            "v": _FORMAT,
            "route": self.route,
            "model": self.model,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
        }
        if self.stop_reason != ():
            entry["stop_reason"] = self.stop_reason
        if self.provenance is not None:
            p = self.provenance
            entry["by"] = [p.writer, p.replica, p.ttft_s, p.duration_s]
        return orjson.dumps(entry)

    @classmethod
    def decode(cls, raw: bytes) -> CachedAnswer | None:
        """None for anything that is not a current entry (a stale format, a damaged value)."""
        try:
            data = orjson.loads(raw)
            if data.get("v") != _FORMAT:
                return None
            by = data.get("by")
            provenance = None
            if by is not None:
                writer, replica, ttft_s, duration_s = by
                provenance = Provenance(str(writer), replica, ttft_s, float(duration_s))
            return cls(
                data["route"],
                data["model"],
                data["text"],
                data["finish_reason"],
                data["usage"],
                provenance,
                data.get("stop_reason", ()),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError):
            return None

    def written_by(self, provenance: Provenance | None) -> CachedAnswer:
        return replace(self, provenance=provenance)

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
        stop = choice.get("stop_reason", ())
        return cls(route, response.get("model", ""), text, finish, usage, None, stop)

    @classmethod
    def from_frames(
        cls, route: str, model: str, frames: Iterable[bytes], usage: dict | None
    ) -> CachedAnswer | None:
        """From a completed stream's SSE frames; None unless it finished plainly."""
        gathered = StreamedAnswer(route, sys.maxsize)
        for frame in frames:
            gathered.add(frame)
        return gathered.answer(model, usage)

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
        if self.stop_reason != ():
            choice["stop_reason"] = self.stop_reason
        return {
            "id": prefix + request_id,
            "object": obj,
            "created": created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage,
        }

    def frames(
        self, request_id: str, include_usage: bool, *, per_token: bool = False
    ) -> list[bytes]:
        """The stream a backend would have sent, in three chunks (role, text, finish), the usage
        chunk when asked for, and ``[DONE]``. ``per_token``: the text a chunk per token, as an
        engine streams it (split by the gateway's tokenizer: the simulated engine's own pieces,
        a near likeness of a real model's)."""
        created = int(time.time())
        texts = _token_pieces(self.text) if per_token else [self.text]
        if self.route == "chat":
            envelope = {"id": "chatcmpl-" + request_id, "object": "chat.completion.chunk"}
            role: list[dict] = [{"role": "assistant", "content": ""}]
            body: list[Any] = [*({"content": t} for t in texts), {}]
        else:
            envelope = {"id": "cmpl-" + request_id, "object": "text_completion"}
            role, body = [], [*texts, ""]
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
            if last and self.stop_reason != ():
                choice["stop_reason"] = self.stop_reason
            chunks.append({**envelope, "choices": [choice], **extra})
        if include_usage:
            chunks.append({**envelope, "choices": [], "usage": self.usage})
        return [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks] + [sse.DONE]


def _token_pieces(text: str) -> list[str]:
    """``text`` as token pieces that join back to exactly ``text`` (trailing white space too)."""
    pieces = tokenizer.tokenize(text)
    rest = text[sum(map(len, pieces)) :]
    if rest:
        pieces.append(rest)
    return pieces or [text]


class StreamedAnswer:
    """A cacheable stream's answer, gathered from its frames as they pass (``relay``).

    Only the text is kept, never the frames: a frame's JSON envelope is ~30 times the text it
    carries, so keeping a stream's frames for its end cost up to 32 x ``max_entry_bytes``
    (8 MiB by default) per cacheable stream in flight. Text past ``limit`` characters could
    never make an entry, and a stream that is not plain (a tool call, a frame that is not
    JSON) never will: either stops the gathering at once, and ``dropped`` says why. Decoding
    each frame as it passes costs what decoding them all at the end did.
    """

    __slots__ = (
        "_joined",
        "_limit",
        "_recent",
        "_route",
        "_size",
        "dropped",
        "finish",
        "last_at",
        "stop_reason",
    )

    # A token's text is a str object of its own (~50 bytes for a few characters): they are
    # joined every this many, so what is held is about the text itself.
    _JOIN_EVERY = 256

    def __init__(self, route: str, limit: int) -> None:
        self._route = route
        self._limit = limit
        self._recent: list[str] | None = []
        self._joined: list[str] = []
        self._size = 0
        self.finish: str | None = None
        self.stop_reason: str | int | tuple[()] | None = ()  # as ``CachedAnswer``'s
        self.dropped: str | None = None  # "too_large" or "not_plain"
        self.last_at: float | None = None  # perf_counter of the last frame

    def add(self, frame: bytes) -> None:
        self.last_at = time.perf_counter()
        recent = self._recent
        if recent is None or not frame.startswith(b"data: {"):
            return
        try:
            chunk = orjson.loads(frame[6:])
            for choice in chunk.get("choices") or ():
                if self._route == "chat":
                    delta = choice.get("delta") or {}
                    if delta.get("tool_calls") or delta.get("function_call"):
                        self._drop("not_plain")
                        return
                    text = delta.get("content")
                else:
                    text = choice.get("text")
                if text:
                    if not isinstance(text, str):
                        self._drop("not_plain")
                        return
                    self._size += len(text)
                    recent.append(text)
                    if len(recent) == self._JOIN_EVERY:
                        self._joined.append("".join(recent))
                        recent.clear()
                self.finish = choice.get("finish_reason") or self.finish
                if "stop_reason" in choice:  # vLLM's, with its last chunk
                    self.stop_reason = choice["stop_reason"]
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            self._drop("not_plain")
            return
        if self._size > self._limit:
            self._drop("too_large")

    def _drop(self, reason: str) -> None:
        self.dropped, self._recent, self._joined = reason, None, []

    def answer(self, model: str, usage: dict | None) -> CachedAnswer | None:
        """The answer, if the stream finished plainly; None otherwise."""
        if self._recent is None or self.finish not in ("stop", "length") or not usage:
            return None
        text = "".join(self._joined) + "".join(self._recent)
        return CachedAnswer(self._route, model, text, self.finish, usage, None, self.stop_reason)
