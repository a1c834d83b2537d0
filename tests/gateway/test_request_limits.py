"""Bodies are bounded on every route the gateway serves, as they arrive: a chunked body (no
Content-Length to refuse up front) is cut off with a 413 once it passes the limit, and a body
that trickles in past the deadline with a 408, on the admin and usage routes too, which FastAPI
would otherwise read whole before checking the key. Through the real ASGI app, no Ray."""

from __future__ import annotations

import asyncio

import orjson

from serve_app.gateway.request_limits import RequestLimits

LIMIT = 1024


async def app_reading_everything(scope, receive, send):
    """What FastAPI does with a body: read it all, then answer."""
    total = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        total += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    app_reading_everything.read = total
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"read"})


def chunks(count: int, size: int, pause_s: float = 0.0):
    sent = {"n": 0}

    async def receive():
        if pause_s:
            await asyncio.sleep(pause_s)
        sent["n"] += 1
        return {"type": "http.request", "body": b"x" * size, "more_body": sent["n"] < count}

    return receive, sent


async def call(path: str, receive, *, body_timeout_s: float = 30.0) -> tuple[list[dict], int]:
    app_reading_everything.read = None
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    limits = RequestLimits(
        app_reading_everything, max_bytes=8192, max_body_bytes=LIMIT, body_timeout_s=body_timeout_s
    )
    scope = {"type": "http", "method": "POST", "path": path, "headers": []}  # chunked: no length
    await limits(scope, receive, send)
    return sent, app_reading_everything.read


async def test_a_chunked_body_past_the_limit_is_cut_off_with_a_413_on_an_admin_route():
    receive, pulled = chunks(count=10_000, size=512)  # 5 MB, were it read whole
    sent, read = await call("/admin/faults", receive)
    assert sent[0]["status"] == 413
    assert orjson.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
    assert read is None, "the app never got a whole body"
    assert pulled["n"] <= LIMIT // 512 + 1, "reading stopped at the limit"
    assert len([m for m in sent if m["type"] == "http.response.start"]) == 1


async def test_a_body_within_the_limit_reaches_the_app_whole():
    receive, _ = chunks(count=2, size=400)
    sent, read = await call("/admin/breakers/reset", receive)
    assert sent[0]["status"] == 200 and read == 800


async def test_a_body_that_trickles_past_the_deadline_is_a_408():
    receive, _ = chunks(count=100, size=1, pause_s=0.05)
    sent, read = await call("/v1/usage", receive, body_timeout_s=0.2)
    assert sent[0]["status"] == 408
    assert read is None


async def test_the_inference_routes_are_left_to_the_parse_stage():
    """Their bodies are read, bounded, counted and metered by the pipeline (``stages/parse.py``)."""
    receive, _ = chunks(count=4, size=512)
    sent, read = await call("/v1/chat/completions", receive)
    assert sent[0]["status"] == 200 and read == 2048
