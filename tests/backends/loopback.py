"""Test servers on real loopback sockets: the mock OpenAI upstream and a fake metadata server.

Real HTTP rather than a MockTransport so the fallback client's own connection handling, headers
and streaming run exactly as they do against Gemini or the GKE metadata server.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

TOKEN_PATH = "/computeMetadata/v1/instance/service-accounts/default/token"


@asynccontextmanager
async def serve_on_loopback(app: ASGIApp) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 in this event loop; yield its base URL.

    The socket is bound and listening before uvicorn starts, so a client may connect at once
    (the kernel queues it): no polling for readiness.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def refused_url() -> str:
    """A loopback URL nothing listens on: connecting to it is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}{TOKEN_PATH}"


class RecordingHeaders:
    """ASGI middleware that keeps each HTTP request's headers: what the upstream really saw."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[Headers] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append(Headers(scope=scope))
        await self.app(scope, receive, send)


class FakeMetadataServer:
    """The GCE/GKE metadata server's token endpoint, scripted by the test.

    Each request gets the next token (``token-1``, ``token-2``, ...) with ``expires_in``, unless
    ``fail_with`` is set. Like the real server, it refuses requests without
    ``Metadata-Flavor: Google``. ``hold`` (when set) keeps answers back until released, so a
    test can pile concurrent callers onto one refresh.
    """

    def __init__(self, expires_in: float = 3600) -> None:
        self.expires_in = expires_in
        self.fail_with: int | None = None
        self.body: bytes | None = None  # a raw body to send instead of a token
        self.hold: asyncio.Event | None = None
        self.arrived = asyncio.Event()
        self.requests: list[Headers] = []
        self.issued = 0
        self.app = Starlette(routes=[Route(TOKEN_PATH, self._token, methods=["GET"])])

    async def _token(self, request: Request) -> Response:
        self.requests.append(request.headers)
        self.arrived.set()
        if self.hold is not None:
            await self.hold.wait()
        if request.headers.get("metadata-flavor") != "Google":
            return Response(b"Missing Metadata-Flavor header.", status_code=403)
        if self.fail_with is not None:
            # A body that looks like a token: the client must not log or echo it.
            return Response(b"ya29.leaked-in-an-error-body", status_code=self.fail_with)
        if self.body is not None:
            return Response(self.body, media_type="application/json")
        self.issued += 1
        token = {
            "access_token": f"token-{self.issued}",
            "expires_in": self.expires_in,
            "token_type": "Bearer",
        }
        return Response(orjson.dumps(token), media_type="application/json")
