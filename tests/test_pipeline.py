"""The pipeline: stages run in the listed order, and the end of a response is observed once."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from serve_app.pipeline import RequestContext, compose, on_response_end


def ctx() -> RequestContext:
    return RequestContext(
        Request({"type": "http", "method": "GET", "path": "/", "headers": []}), "chat"
    )


async def test_stages_run_in_order_around_the_endpoint():
    seen: list[str] = []

    def stage(name: str):
        async def run(c, call_next):
            seen.append(f"{name}>")
            response = await call_next(c)
            seen.append(f"<{name}")
            return response

        return run

    async def endpoint(c):
        seen.append("endpoint")
        return Response(b"")

    await compose([stage("a"), stage("b")], endpoint)(ctx())
    assert seen == ["a>", "b>", "endpoint", "<b", "<a"]


async def test_a_plain_response_ends_at_once():
    calls = []
    on_response_end(Response(b"x"), calls.append)
    assert calls == [True]


async def test_a_stream_ends_after_its_last_chunk():
    async def body():
        yield b"1"
        yield b"2"

    calls = []
    response = on_response_end(StreamingResponse(body()), calls.append)
    chunks = []
    async for chunk in response.body_iterator:
        assert calls == []
        chunks.append(chunk)
    assert chunks == [b"1", b"2"] and calls == [True]


async def test_a_stream_the_client_left_ends_incomplete_exactly_once():
    async def body():
        for i in range(10):
            yield str(i).encode()

    calls = []
    response = on_response_end(StreamingResponse(body()), calls.append)
    iterator = response.body_iterator
    await anext(iterator)
    await iterator.aclose()  # what Starlette does when the client disconnects
    assert calls == [False]


async def test_an_event_stream_the_client_left_before_its_body_still_cleans_up():
    """Headers go out before the body is read; a client gone in between must not leak."""
    from serve_app.pipeline import EventStream

    started, closed, ended = [], [], []

    async def body():
        started.append(True)
        yield b"data: 1\n\n"

    async def close_source():
        closed.append(True)

    response = EventStream(body(), close_source=close_source, headers={})
    on_response_end(response, ended.append)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        raise OSError("client went away")  # fails on the very first message: the headers

    with contextlib.suppress(OSError, ClientDisconnect):
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    assert started == [] and closed == [True] and ended == [False]


async def test_an_event_stream_never_called_still_cleans_up_once_dropped():
    """Its request was cancelled between the pipeline's return and the server's call: nobody
    will ever call it, yet the slot, lease and renewers its stages hold must come back."""
    import gc

    from serve_app.pipeline import EventStream

    closed, ended = [], []

    async def body():
        yield b"data: 1\n\n"

    async def close_source():
        closed.append(True)

    response = EventStream(body(), close_source=close_source, headers={})
    on_response_end(response, ended.append)
    del response
    gc.collect()
    for _ in range(5):
        await asyncio.sleep(0)
    assert closed == [True] and ended == [False]


async def test_an_event_stream_that_was_called_does_not_end_twice_when_dropped():
    import gc

    from serve_app.pipeline import EventStream

    ended = []

    async def body():
        yield b"data: 1\n\n"

    async def close_source():
        return None

    response = EventStream(body(), close_source=close_source, headers={})
    on_response_end(response, ended.append)
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    del response
    gc.collect()
    for _ in range(5):
        await asyncio.sleep(0)
    assert ended == [True]
