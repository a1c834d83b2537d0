"""The request id: a client's tame id is kept and echoed, anything else is replaced by a minted
one, and inside Serve, Serve's own id is used and its header left to Serve."""

from __future__ import annotations

import re

import pytest
from starlette.requests import Request
from starlette.responses import Response

from serve_app.pipeline import RequestContext
from serve_app.stages import request_id
from serve_app.stages.request_id import RequestIdStage

MINTED = re.compile(r"[0-9a-f]{32}")


def ctx_with(header: bytes | None = None) -> RequestContext:
    headers = [] if header is None else [(b"x-request-id", header)]
    request = Request(
        {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}
    )
    return RequestContext(request=request, route="chat")


async def run(ctx: RequestContext) -> tuple[Response, list[str]]:
    """The stage around an endpoint that notes the id the rest of the pipeline sees."""
    seen: list[str] = []

    async def endpoint(c: RequestContext) -> Response:
        seen.append(c.request_id)
        return Response(b"{}")

    return await RequestIdStage()(ctx, endpoint), seen


@pytest.mark.parametrize(
    "given", ["client-id-42", "7f0c.9a:run_3-b", "A" * 128], ids=["plain", "punctuated", "128"]
)
async def test_a_clients_acceptable_id_is_kept_and_echoed(given):
    response, seen = await run(ctx_with(given.encode()))
    assert seen == [given]
    assert response.headers["x-request-id"] == given


@pytest.mark.parametrize(
    "given",
    [
        b"A" * 129,
        b"two words",
        b"abc\r\nset-cookie: session=stolen",
        b"abc\nx-forge-tenant: admin",
        b"caf\xc3\xa9",
        b"",
    ],
    ids=["too-long", "space", "crlf-injection", "newline-injection", "non-ascii", "empty"],
)
async def test_an_unacceptable_id_is_replaced_by_a_minted_one(given):
    response, seen = await run(ctx_with(given))
    [used] = seen
    assert MINTED.fullmatch(used)
    assert response.headers["x-request-id"] == used
    assert response.headers.getlist("x-request-id") == [used]


async def test_without_an_id_one_is_minted_per_request():
    first, seen_first = await run(ctx_with())
    second, seen_second = await run(ctx_with())
    assert MINTED.fullmatch(seen_first[0]) and MINTED.fullmatch(seen_second[0])
    assert seen_first != seen_second
    assert first.headers["x-request-id"] == seen_first[0]
    assert second.headers["x-request-id"] == seen_second[0]


async def test_inside_serve_serves_id_is_used_and_the_header_left_to_serve(monkeypatch):
    monkeypatch.setattr(request_id, "_serve_request_id", lambda: "serve-id-1")
    response, seen = await run(ctx_with(b"client-id-ignored"))
    assert seen == ["serve-id-1"]
    assert "x-request-id" not in response.headers  # Serve sets it: the client sees one header


async def test_inside_serve_an_unacceptable_serve_id_is_replaced_inside_forge(monkeypatch):
    # Serve echoes a client's id as it came; what Forge logs and passes on must be tame.
    monkeypatch.setattr(request_id, "_serve_request_id", lambda: "two words")
    response, seen = await run(ctx_with())
    assert MINTED.fullmatch(seen[0])
    assert "x-request-id" not in response.headers


@pytest.mark.parametrize("serve_context", [False, True], ids=["outside-serve", "inside-serve"])
async def test_an_id_with_a_trailing_newline_is_replaced(monkeypatch, serve_context):
    given = "abc\n"
    if serve_context:
        monkeypatch.setattr(request_id, "_serve_request_id", lambda: given)
    _, seen = await run(ctx_with(given.encode()))
    assert MINTED.fullmatch(seen[0])
