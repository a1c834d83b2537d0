"""SSE framing: events re-framed whole however the network splits or merges them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest

from serve_app import sse


async def reads(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def split(*chunks: bytes) -> list[list[bytes]]:
    return [events async for events in sse.split_frames(reads(*chunks))]


def test_frame_is_data_line_json_and_blank_line():
    event = sse.frame({"a": 1, "b": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert orjson.loads(sse.frame_data(event)) == {"a": 1, "b": "é"}


def test_frame_data_of_done():
    assert sse.frame_data(sse.DONE) == b"[DONE]"


async def test_event_split_across_reads_is_rejoined():
    assert await split(b'data: {"a"', b":1}\n", b"\n") == [[b'data: {"a":1}\n\n']]


async def test_events_merged_in_one_read_stay_one_list():
    assert await split(b"data: 1\n\ndata: 2\n\n") == [[b"data: 1\n\n", b"data: 2\n\n"]]


async def test_one_list_per_read():
    assert await split(b"data: 1\n\ndata: 2\n\nda", b"ta: 3\n\n", b"data: 4\n\n") == [
        [b"data: 1\n\n", b"data: 2\n\n"],
        [b"data: 3\n\n"],
        [b"data: 4\n\n"],
    ]


async def test_read_without_a_whole_event_yields_nothing():
    assert await split(b"data: 1", b"23", b"\n\n") == [[b"data: 123\n\n"]]


async def test_crlf_line_ends_are_normalised():
    assert await split(b"data: 1\r\n\r\ndata: 2\r\n\r\n") == [[b"data: 1\n\n", b"data: 2\n\n"]]


async def test_crlf_split_between_cr_and_lf():
    # A read may end between \r and \n; the two events must still come out separate.
    assert await split(b"data: 1\r\n\r", b"\ndata: 2\r\n\r\n") == [[b"data: 1\n\n", b"data: 2\n\n"]]


async def test_trailing_event_without_blank_line_is_flushed():
    assert await split(b"data: 1\n\ndata: 2") == [[b"data: 1\n\n"], [b"data: 2\n\n"]]
    assert await split(b"data: 3\n") == [[b"data: 3\n\n"]]


async def test_blank_keepalives_and_empty_stream_yield_nothing():
    assert await split(b"\n\n", b"\n\n") == []
    assert await split() == []


async def test_an_event_that_grows_past_the_cap_without_ending_is_an_error():
    """The splitter buffers one unfinished event at most, never an upstream's whole output."""
    endless = (b"data: " + b"x" * 1000 for _ in range(10))
    with pytest.raises(sse.FrameTooLarge):
        [events async for events in sse.split_frames(reads(*endless), max_frame_bytes=4096)]


async def test_a_whole_event_over_the_cap_is_an_error_and_one_under_it_passes():
    big = b"data: " + b"x" * 5000 + b"\n\n"
    with pytest.raises(sse.FrameTooLarge):
        [events async for events in sse.split_frames(reads(big), max_frame_bytes=4096)]
    fits = b"data: " + b"x" * 4000 + b"\n\n"
    assert [e async for e in sse.split_frames(reads(fits[:9], fits[9:]), max_frame_bytes=4096)] == [
        [fits]
    ]
