"""The last stage: pick the backend for the model, relay its answer, fail over before byte one.

Failover happens only while nothing has reached the client: a stream is committed (headers
sent) after its first batch has arrived, so a replica that dies or errors before that costs
the client nothing but latency. After the first byte, a failure ends the stream honestly with
an SSE error event; text the client has seen is never repeated or spliced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence

import orjson
from starlette.responses import Response

from serve_app import errors, sse
from serve_app.backends.base import Backend
from serve_app.pipeline import EventStream, RequestContext

logger = logging.getLogger("ray.serve")

_STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class Dispatch:
    def __init__(self, routes: dict[str, Sequence[Backend]]) -> None:
        # model name → backends in order of preference (primary pool, then fallback)
        self.routes = routes

    async def __call__(self, ctx: RequestContext) -> Response:
        candidates = self.routes.get(ctx.parsed.model)
        if not candidates:
            raise errors.model_not_found(ctx.parsed.model)
        if ctx.parsed.stream:
            return await self._stream(ctx, candidates)
        return await self._complete(ctx, candidates)

    async def _complete(self, ctx: RequestContext, candidates: Sequence[Backend]) -> Response:
        failure: errors.ForgeError | None = None
        for backend in candidates:
            try:
                result = await backend.complete(ctx.body, ctx.route, ctx.request_id)
            except errors.ForgeError as err:
                if err.status < 500:
                    raise
                failure = err
                continue
            _release_pool_slot_on_failover(ctx, backend, candidates)
            response = result["response"]
            ctx.backend, ctx.replica, ctx.usage = (
                backend.name,
                result["replica"],
                response.get("usage"),
            )
            ctx.first_byte_at = time.perf_counter()
            return Response(
                orjson.dumps(response), media_type="application/json", headers=_served_by(ctx)
            )
        raise failure or errors.backend_unavailable()

    async def _stream(self, ctx: RequestContext, candidates: Sequence[Backend]) -> Response:
        failure: errors.ForgeError | None = None
        for backend in candidates:
            stream = backend.stream(ctx.body, ctx.route, ctx.request_id)
            try:
                first = await anext(stream, [])
            except errors.ForgeError as err:
                await stream.aclose()
                if err.status < 500:
                    raise
                failure = err
                continue
            ctx.backend = backend.name
            _release_pool_slot_on_failover(ctx, backend, candidates)
            head = _take(ctx, first)
            return EventStream(
                _relay(ctx, head, stream),
                close_source=stream.aclose,
                headers={**_STREAM_HEADERS, **_served_by(ctx)},
            )
        raise failure or errors.backend_unavailable()


def _release_pool_slot_on_failover(
    ctx: RequestContext, backend: Backend, candidates: Sequence[Backend]
) -> None:
    """The pool's admission slot guards the pool's GPUs: a request the fallback serves gives
    it back now instead of holding it for the whole external generation."""
    if backend is not candidates[0] and ctx.release_slot is not None:
        ctx.release_slot()


def _served_by(ctx: RequestContext) -> dict[str, str]:
    headers = {"x-forge-backend": ctx.backend}
    if ctx.replica:
        headers["x-forge-replica"] = ctx.replica
    return headers


def _take(ctx: RequestContext, batch: list) -> bytes:
    """The frames of a batch as one write; metadata items are kept on the context."""
    frames = []
    for item in batch:
        if type(item) is bytes:
            frames.append(item)
            ctx.frames_sent += 1
        elif "usage" in item:
            ctx.usage = item["usage"]
        elif "replica" in item:
            ctx.replica = item["replica"]
    return b"".join(frames)


async def _relay(ctx: RequestContext, head: bytes, stream: AsyncIterator[list]):
    try:
        if head:
            ctx.first_byte_at = time.perf_counter()
            yield head
        async for batch in stream:
            out = _take(ctx, batch)
            if out:
                if ctx.first_byte_at is None:
                    ctx.first_byte_at = time.perf_counter()
                yield out
        yield sse.DONE
    except errors.ForgeError as err:
        ctx.stream_error = err.message
        yield errors.error_event(err)
    except Exception:
        # Headers are sent: the only honest end left is an error event, never a truncation.
        logger.exception("stream %s failed after its first byte", ctx.request_id)
        err = errors.bad_gateway("The stream failed after it started.")
        ctx.stream_error = err.message
        yield errors.error_event(err)
    finally:
        await stream.aclose()
