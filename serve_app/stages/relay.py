"""Relaying a backend's stream to the client once its first batch has arrived.

The response is committed then (headers sent), so whatever happens next ends the stream
honestly: ``[DONE]`` after the last frame, or an SSE error event, never a silent truncation and
never text repeated or spliced from another backend. How it ended is reported once through
``on_end`` (for the attempt's breakers); a client that leaves mid-stream is no verdict.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from serve_app import errors, sse
from serve_app.pipeline import RequestContext
from serve_app.resilience.breaker import Outcome
from serve_app.resilience.outcomes import classify

logger = logging.getLogger("ray.serve")

# An SSE stream's own headers: a backend's, and a cached answer's, which must not differ from it.
STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def relay(
    ctx: RequestContext,
    head: bytes,
    stream: AsyncIterator[list],
    on_end: Callable[[Outcome], None],
) -> AsyncIterator[bytes]:
    """``head`` (the first batch's frames), then the rest of ``stream``, then ``[DONE]``."""
    outcome = Outcome.NEUTRAL  # unless it ends one way or the other: the client left
    try:
        if head:
            ctx.first_byte_at = time.perf_counter()
            yield head
        async for batch in stream:
            out = take_frames(ctx, batch)
            if out:
                if ctx.first_byte_at is None:
                    ctx.first_byte_at = time.perf_counter()
                yield out
        outcome = Outcome.SUCCESS
        yield sse.DONE
    except errors.ForgeError as failed:
        err = ctx.own_timeout(failed)
        outcome = classify(err)
        ctx.stream_error = err.message
        yield errors.error_event(err)
    except Exception:
        # Headers are sent: the only honest end left is an error event, never a truncation.
        logger.exception("stream %s failed after its first byte", ctx.request_id)
        outcome = Outcome.FAILURE
        err = errors.bad_gateway("The stream failed after it started.")
        ctx.stream_error = err.message
        yield errors.error_event(err)
    finally:
        on_end(outcome)
        await stream.aclose()


class ClosedOnce:
    """A backend's stream that two ends may close at once: the relay's ``finally`` (in the
    request's task, which the server cancels when the client leaves) and the response's end
    (``EventStream``'s ``close_source``, in a task of its own).

    A second ``aclose`` of an async generator still closing raises "already running"; the
    response's end then never asked the replica what the stream cost, and the tenant was
    charged an estimate. Here the first caller closes it and any other waits for that close
    to end (however it ends: a cancelled first caller's close ends with it).
    """

    def __init__(self, stream: AsyncIterator[list]) -> None:
        self._stream = stream
        self._closing: asyncio.Future | None = None

    def __aiter__(self) -> ClosedOnce:
        return self

    def __anext__(self):
        return self._stream.__anext__()

    async def aclose(self) -> None:
        if self._closing is not None:
            await asyncio.shield(self._closing)
            return
        self._closing = asyncio.get_running_loop().create_future()
        try:
            await self._stream.aclose()
        finally:
            self._closing.set_result(None)


def take_frames(ctx: RequestContext, batch: list) -> bytes:
    """The frames of a batch as one write; metadata items are kept on the context."""
    frames = []
    for item in batch:
        if type(item) is bytes:
            frames.append(item)
            ctx.frames_sent += 1
            if ctx.gathered is not None:
                ctx.gathered.add(item)
        elif "usage" in item:
            ctx.usage = item["usage"]
        elif "replica" in item:
            ctx.replica = item["replica"]
    return b"".join(frames)
