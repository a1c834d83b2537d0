"""Bearer key → tenant, before anything else touches the request. Fails closed."""

from __future__ import annotations

from starlette.responses import Response

from serve_app.auth import KeyRing
from serve_app.pipeline import Handler, RequestContext


class AuthStage:
    def __init__(self, keyring: KeyRing) -> None:
        self.keyring = keyring

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        ctx.tenant = self.keyring.tenant_for(ctx.request.headers.get("authorization"))
        return await call_next(ctx)
