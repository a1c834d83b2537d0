"""Parse: the body under its size limit, and the client's own deadline from its headers."""

from __future__ import annotations

import orjson
import pytest
from starlette.requests import Request
from starlette.responses import Response

from serve_app.config.models import GatewayConfig
from serve_app.errors import ForgeError
from serve_app.pipeline import RequestContext
from serve_app.stages.parse import ParseStage

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def ctx_with(headers: dict[str, str], stream: bool = False) -> RequestContext:
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        body = orjson.dumps({**BODY, "stream": stream})
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }
    return RequestContext(Request(scope, receive), "chat")


async def parsed(headers: dict[str, str], stream: bool = False) -> RequestContext:
    ctx = ctx_with(headers, stream)

    async def endpoint(c: RequestContext) -> Response:
        return Response()

    await ParseStage(GatewayConfig(max_body_bytes=1 << 20))(ctx, endpoint)
    return ctx


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({}, None),
        ({"x-request-timeout": "12.5"}, 12.5),
        ({"x-stainless-timeout": "600"}, 600.0),  # what the SDKs send
        ({"x-request-timeout": "3", "x-stainless-timeout": "600"}, 3.0),  # ours wins
        ({"x-stainless-timeout": "soon"}, None),  # advisory: a strange one is ignored
        ({"x-request-timeout": "0"}, None),
    ],
)
async def test_the_client_deadline_comes_from_its_headers(headers, seconds):
    assert (await parsed(headers)).client_timeout_s == seconds


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"x-stainless-timeout": "60"}, None),
        ({"x-request-timeout": "3", "x-stainless-timeout": "60"}, 3.0),
        ({"x-request-timeout": "3"}, 3.0),
    ],
)
async def test_a_streams_deadline_is_ours_alone_not_the_sdks_timeout(headers, seconds):
    """The SDKs' timeout times the wait for headers or between chunks, not a whole stream."""
    assert (await parsed(headers, stream=True)).client_timeout_s == seconds


async def test_a_malformed_x_request_timeout_is_a_400_before_anything_is_spent():
    with pytest.raises(ForgeError) as info:
        await parsed({"x-request-timeout": "soon"})
    assert info.value.status == 400 and info.value.param == "x-request-timeout"
