"""Server-sent events as OpenAI streams them: ``data: <json>\\n\\n`` frames, then ``[DONE]``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson

DONE = b"data: [DONE]\n\n"


def frame(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def frame_data(event: bytes) -> bytes:
    """The payload of one ``data:`` frame, without the field name, the optional space after
    the colon (SSE allows both ``data: x`` and ``data:x``) and the blank line."""
    if event.startswith(b"data:"):
        return event[5:].strip()
    return event.strip()


# The largest event ``split_frames`` waits for. A chat stream's event is one step's delta, a
# few hundred bytes (a slow reader's merged delta, or a tool call's arguments, some KiB); an
# upstream that sends more without a blank line is broken or hostile, and buffering it would
# let it grow the gateway's memory without bound.
MAX_FRAME_BYTES = 1 << 20


class FrameTooLarge(ValueError):
    """An upstream event grew past ``MAX_FRAME_BYTES`` before it ended."""


async def split_frames(
    chunks: AsyncIterator[bytes], max_frame_bytes: int = MAX_FRAME_BYTES
) -> AsyncIterator[list[bytes]]:
    """Re-frame a byte stream into whole SSE events, a list per network read.

    Upstream servers may split or merge events across reads; downstream we pass events through
    unchanged, so only the framing is parsed, never the JSON inside. Events that arrived
    together stay together (one downstream write instead of several). What is buffered is at
    most one unfinished event: past ``max_frame_bytes`` it raises ``FrameTooLarge``.
    """
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\r" in buffer:  # normalise on the buffer: a CRLF may be split across two reads
            buffer = buffer.replace(b"\r\n", b"\n")
        events = []
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            event = buffer[start : end + 2]
            start = end + 2
            if len(event) > max_frame_bytes:
                raise FrameTooLarge(f"an upstream event is larger than {max_frame_bytes} bytes")
            if event.strip():
                events.append(event)
        buffer = buffer[start:]
        if len(buffer) > max_frame_bytes:
            raise FrameTooLarge(f"an upstream event grew past {max_frame_bytes} bytes")
        if events:
            yield events
    if buffer.strip():
        yield [buffer.rstrip(b"\n") + b"\n\n"]
