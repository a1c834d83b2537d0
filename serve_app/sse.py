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


async def split_frames(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """Re-frame a byte stream into whole SSE events, a list per network read.

    Upstream servers may split or merge events across reads; downstream we pass events through
    unchanged, so only the framing is parsed, never the JSON inside. Events that arrived
    together stay together (one downstream write instead of several).
    """
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        if b"\r" in buffer:  # normalise on the buffer: a CRLF may be split across two reads
            buffer = buffer.replace(b"\r\n", b"\n")
        events = []
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[: end + 2], buffer[end + 2 :]
            if event.strip():
                events.append(event)
        if events:
            yield events
    if buffer.strip():
        yield [buffer.rstrip(b"\n") + b"\n\n"]
