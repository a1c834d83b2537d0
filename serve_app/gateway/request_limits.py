"""Oversized or slow requests are refused in OpenAI's error shape before they cost anything:
headers over their limit (431) on every route; and on the routes the pipeline does not read (the
admin and usage API, which FastAPI would otherwise read whole before it checks the key), a body
over its limit (413), declared or counted as it streams in (a chunked body declares nothing),
and a body not in within the deadline (408). The inference routes' parse stage bounds theirs
the same way, and counts and meters what it refuses.

The servers in front (HAProxy, uvicorn) bound a single header line; this bounds the sum, which a
flood of many small headers would otherwise pass. Pure ASGI: nothing is parsed or allocated for
a request within the limits.
"""

from __future__ import annotations

import asyncio

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve_app import errors

# Routes whose bodies the pipeline reads under its own limits (and counts what it refuses).
# Theirs answer in the route's own shape (Anthropic's on the Messages routes).
_PIPELINE_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)


class RequestLimits:
    def __init__(
        self, app: ASGIApp, max_bytes: int, max_body_bytes: int, body_timeout_s: float = 30.0
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = 0
        declared = None
        for name, value in scope["headers"]:
            size += len(name) + len(value)
            if name == b"content-length":
                declared = value
        if size > self.max_bytes:
            await _refuse(send, errors.headers_too_large(self.max_bytes))
            return
        if scope["path"] in _PIPELINE_PATHS:
            await self.app(scope, receive, send)
            return
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await _refuse(send, errors.payload_too_large(self.max_body_bytes))
            return
        await _BoundedBody(self, scope, receive, send).run()


class _BoundedBody:
    """One request whose body is counted, and timed, as the app reads it. Past a limit the
    refusal is sent here, the app is told the client left (it stops reading) and whatever it
    would still send is dropped."""

    def __init__(self, limits: RequestLimits, scope: Scope, receive: Receive, send: Send) -> None:
        self.limits, self.scope, self._receive, self._send = limits, scope, receive, send
        self.read = 0
        self.refused = False
        self.started = False
        self.deadline = asyncio.get_running_loop().time() + limits.body_timeout_s
        self.body_done = False

    async def run(self) -> None:
        await self.limits.app(self.scope, self.receive, self.send)

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        if self.body_done:
            return await self._receive()  # after the body: the client's disconnect, if any
        try:
            async with asyncio.timeout_at(self.deadline):
                message = await self._receive()
        except TimeoutError:
            return await self._refuse(errors.body_timeout(self.limits.body_timeout_s))
        if message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if self.read > self.limits.max_body_bytes:
                return await self._refuse(errors.payload_too_large(self.limits.max_body_bytes))
            if not message.get("more_body"):
                self.body_done = True
        return message

    async def _refuse(self, err: errors.ForgeError) -> Message:
        self.refused = True
        if not self.started:
            await _refuse(self._send, err)
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.refused:
            return  # the refusal was the answer
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


async def _refuse(send: Send, err: errors.ForgeError) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": orjson.dumps(err.body())})
