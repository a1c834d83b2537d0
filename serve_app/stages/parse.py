"""Read the body under a size limit and validate it; 413 and 400 are decided here."""

from __future__ import annotations

from starlette.responses import Response

from serve_app import errors, protocol
from serve_app.pipeline import Handler, RequestContext

_MODELS = {"chat": protocol.ChatCompletionRequest, "completion": protocol.CompletionRequest}


class ParseStage:
    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        raw = await self._read(ctx)
        ctx.body, ctx.parsed = protocol.parse_request(raw, _MODELS[ctx.route])
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
