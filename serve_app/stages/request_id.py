"""Every request has an id, returned to the client and passed to every backend."""

from __future__ import annotations

import re
import uuid

from ray import serve
from starlette.responses import Response

from serve_app.pipeline import Handler, RequestContext

HEADER = "x-request-id"
# A client's id is echoed into headers and logs: accept only a conservative shape.
_ACCEPTABLE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def mint() -> str:
    return uuid.uuid4().hex


class RequestIdStage:
    """Reuses Serve's own request id when there is one.

    Serve's HTTP layer already accepts ``x-request-id`` (or mints one), tags its logs with it
    and returns it on the response; taking the same id keeps Serve's logs, ours and the
    backends' joined on one key, and the client sees exactly one header.
    """

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        serve_id = _serve_request_id()
        if serve_id:
            # Serve echoes the client's id in the header as it came; what we log and pass to
            # backends must be tame, so an unacceptable one is replaced inside Forge.
            ctx.request_id = serve_id if _ACCEPTABLE.fullmatch(serve_id) else mint()
            return await call_next(ctx)
        given = ctx.request.headers.get(HEADER)
        ctx.request_id = given if given and _ACCEPTABLE.fullmatch(given) else mint()
        response = await call_next(ctx)
        response.headers[HEADER] = ctx.request_id
        return response


def _serve_request_id() -> str:
    try:
        return serve.context._get_serve_request_context().request_id
    except Exception:  # outside a Serve replica
        return ""
