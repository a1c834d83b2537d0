"""Oversized request headers are refused before any route runs: a 431 in OpenAI's error shape.

The servers in front (HAProxy, uvicorn) bound a single header line; this bounds the sum, which a
flood of many small headers would otherwise pass, and it holds for every route, the admin API's
included. Pure ASGI: nothing is parsed or allocated for a request within the limit.
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app import errors


class HeaderLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) for name, value in scope["headers"])
            if size > self.max_bytes:
                err = errors.headers_too_large(self.max_bytes)
                await send(
                    {
                        "type": "http.response.start",
                        "status": err.status,
                        "headers": [(b"content-type", b"application/json")],
                    }
                )
                await send({"type": "http.response.body", "body": orjson.dumps(err.body())})
                return
        await self.app(scope, receive, send)
