"""Read the body under a size limit and validate it; 413 and 400 are decided here."""

from __future__ import annotations

import math

from starlette.responses import Response

from serve_app import errors, protocol
from serve_app.pipeline import Handler, RequestContext

_MODELS = {"chat": protocol.ChatCompletionRequest, "completion": protocol.CompletionRequest}
# A client's own deadline, in seconds: ours, then the one the OpenAI SDKs send with every call.
_TIMEOUT_HEADERS = ("x-request-timeout", "x-stainless-timeout")


class ParseStage:
    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        raw = await self._read(ctx)
        ctx.body, ctx.parsed = protocol.parse_request(raw, _MODELS[ctx.route])
        ctx.client_timeout_s = _client_timeout(ctx)
        return await call_next(ctx)

    async def _read(self, ctx: RequestContext) -> bytes:
        limit = self.max_body_bytes
        declared = ctx.request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise errors.payload_too_large(limit)
        chunks, size = [], 0
        async for chunk in ctx.request.stream():  # also bounds chunked bodies
            size += len(chunk)
            if size > limit:
                raise errors.payload_too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)


def _client_timeout(ctx: RequestContext) -> float | None:
    """Checked here, before quota and admission spend anything on a request that is malformed."""
    headers = ctx.request.headers
    for name in _TIMEOUT_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value)
        except ValueError:
            if name == "x-request-timeout":
                raise errors.invalid_request(
                    "x-request-timeout must be a number of seconds.", param=name
                ) from None
            continue  # the SDK's header is advisory; a strange one is ignored
        if seconds > 0 and math.isfinite(seconds):
            return seconds
    return None
