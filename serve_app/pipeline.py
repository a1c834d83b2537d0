"""The request pipeline: an ordered list of small stages, composed in one place.

A stage is ``async (ctx, call_next) -> Response``, like a Starlette middleware: it may act
before the rest of the pipeline, after it, or answer on its own (a 401, a 429, a cache hit).
The gateway lists the stages in the design's order; each stage is a module of ``stages/``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from serve_app.config import TenantConfig
from serve_app.engines.base import Kind

Handler = Callable[["RequestContext"], Awaitable[Response]]


@dataclass(slots=True)
class RequestContext:
    """What one request carries through the stages; later stages read what earlier ones set."""

    request: Request
    route: Kind | str  # "chat", "completion", or a non-inference route such as "models"
    started: float = field(default_factory=time.perf_counter)
    request_id: str = ""
    tenant: TenantConfig | None = None
    body: dict[str, Any] | None = None  # the client's JSON, forwarded to the backend
    parsed: Any = None  # the validated protocol model
    backend: str = "none"
    replica: str | None = None
    usage: dict | None = None
    first_byte_at: float | None = None
    frames_sent: int = 0  # SSE frames relayed: the usage estimate when a stream is abandoned
    stream_error: str | None = None  # set when a stream ended with an SSE error event

    @property
    def tenant_name(self) -> str:
        return self.tenant.name if self.tenant else "anonymous"


class Stage(Protocol):
    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response: ...


def on_response_end(response: Response, callback: Callable[[bool], None]) -> Response:
    """Call ``callback(completed)`` once the response has ended.

    For a stream that is when its last byte is sent, or when the client went away mid-way
    (``completed`` False); for any other response it is now. ``callback`` must not block; async
    work it needs (a store round trip) it schedules itself.
    """
    if isinstance(response, StreamingResponse):
        response.body_iterator = _observed(response.body_iterator, callback)
    else:
        callback(True)
    return response


async def _observed(body: AsyncIterator, callback: Callable[[bool], None]) -> AsyncIterator:
    completed = False
    try:
        async for chunk in body:
            yield chunk
        completed = True
    finally:
        callback(completed)


def compose(stages: Sequence[Stage], endpoint: Handler) -> Handler:
    """Chain stages in order around the endpoint (the first stage runs first)."""
    handler = endpoint
    for stage in reversed(stages):
        handler = _bind(stage, handler)
    return handler


def _bind(stage: Stage, call_next: Handler) -> Handler:
    async def handler(ctx: RequestContext) -> Response:
        return await stage(ctx, call_next)

    return handler
