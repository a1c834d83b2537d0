"""Oversized requests are refused before any route runs, in OpenAI's error shape: headers over
their limit (431) on every route, and a declared body over its limit (413) on the routes the
pipeline does not read (the admin and usage API, which FastAPI would otherwise read whole before
it checks the key; the inference routes' parse stage bounds theirs, counted and metered).

The servers in front (HAProxy, uvicorn) bound a single header line; this bounds the sum, which a
flood of many small headers would otherwise pass. Pure ASGI: nothing is parsed or allocated for
a request within the limits.
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from serve_app import errors

# Routes whose bodies the pipeline reads under its own limits (and counts what it refuses).
_PIPELINE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class RequestLimits:
    def __init__(self, app: ASGIApp, max_bytes: int, max_body_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = 0
            declared = None
            for name, value in scope["headers"]:
                size += len(name) + len(value)
                if name == b"content-length":
                    declared = value
            err = None
            if size > self.max_bytes:
                err = errors.headers_too_large(self.max_bytes)
            elif (
                declared is not None
                and scope["path"] not in _PIPELINE_PATHS
                and (not declared.isdigit() or int(declared) > self.max_body_bytes)
            ):
                err = errors.payload_too_large(self.max_body_bytes)
            if err is not None:
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
