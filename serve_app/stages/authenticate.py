"""API key (a bearer, or ``x-api-key``) → tenant, before anything else touches the request.
Fails closed: a wrong key is a 401, or a 429 once its client keeps sending wrong keys
(``serve_app/auth/throttle.py``)."""

from __future__ import annotations

from starlette.responses import Response

from serve_app.auth.keys import KeyRing
from serve_app.auth.throttle import FailedAuthThrottle, authenticate
from serve_app.pipeline import Handler, RequestContext


class AuthStage:
    def __init__(self, keyring: KeyRing, throttle: FailedAuthThrottle | None = None) -> None:
        self.keyring = keyring
        self.throttle = throttle

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        request = ctx.request
        ctx.tenant = authenticate(
            self.keyring,
            bearer(request.headers),
            request.client.host if request.client else None,
            self.throttle,
        )
        return await call_next(ctx)


def bearer(headers) -> str | None:
    """The key as ``Authorization: Bearer``; else Anthropic's ``x-api-key`` (what its SDK and
    Claude Code send), as a bearer. A wrong key is a 401 either way."""
    authorization = headers.get("authorization")
    if authorization is None and (key := headers.get("x-api-key")) is not None:
        return f"Bearer {key}"
    return authorization
