"""What of a client's request reaches the fallback, and what of the fallback's key reaches a
client: the gateway wired in process (``serve_app/local.py``) with its primary pool failing, so
the real ``FallbackBackend`` serves, into an upstream that records every header it is sent.

The upstream gets the body (the fields it takes), the request id, and Forge's own credential;
never the client's ``Authorization`` or any other header of the client's (cookies, other
providers' key headers, proxy credentials, forwarding headers). The fallback's key goes to the
upstream and nowhere else: not into an answer or an error the client sees, even when the
upstream's own error quotes it back, and not into a log record.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest

from serve_app.config.models import load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.mock_openai import create_mock_app
from tests.backends.loopback import RecordingHeaders
from tests.gateway.test_server import FAST, KEY, KEY_ENV, MODEL, UPSTREAM_KEY, forge_args

# What a client may send that is for Forge, or for no one: none of it may travel upstream.
CLIENT_HEADERS = {
    "authorization": f"Bearer {KEY}",
    "cookie": "session=client-cookie-value",
    "x-api-key": "client-x-api-key-value",
    "api-key": "client-azure-api-key-value",
    "x-goog-api-key": "client-goog-api-key-value",
    "proxy-authorization": "Basic client-proxy-credentials",
    "openai-organization": "org-client-value",
    "openai-project": "proj-client-value",
    "x-forwarded-for": "203.0.113.7",
    "forwarded": "for=203.0.113.7",
    "x-real-ip": "203.0.113.7",
    "user-agent": "client-agent/1.0",
    "x-stainless-timeout": "599.75",  # not hex: a Forge id (32 hex digits) cannot contain it
    "x-custom-header": "client-custom-value",
}
# Everything the upstream may see: httpx's own request headers, the body's type and length,
# Forge's credential, the request id (and ``traceparent`` when tracing is on; it is off here).
UPSTREAM_MAY_SEE = {
    "host",
    "accept",
    "accept-encoding",
    "connection",
    "user-agent",
    "content-type",
    "content-length",
    "authorization",
    "x-request-id",
    "traceparent",
}
REQUEST_ID = "req-upstream-headers-1"


@asynccontextmanager
async def failing_over(upstream: httpx.AsyncBaseTransport) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a gateway whose primary pool fails every request: the fallback serves."""
    args = forge_args()
    args["fallback"]["kinds"] = ["chat", "completion"]  # the mock serves both
    gateway = build_local_gateway(load_config(args), fallback_transport=upstream)
    async with gateway.lifespan():
        fail_primary(gateway)
        transport = httpx.ASGITransport(gateway.asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://forge.test") as client:
            yield client


def fail_primary(gateway: Gateway) -> None:
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "error"})


def body(route: str, stream: bool) -> dict:
    if route == "/v1/completions":
        return {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}
    messages = [{"role": "user", "content": "hello"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": stream}


@pytest.fixture
def recording(monkeypatch) -> RecordingHeaders:
    """The mock fallback (it checks Forge's key), recording the headers of each request."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    return RecordingHeaders(create_mock_app("mock-gemini", FAST, api_key=UPSTREAM_KEY))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_the_fallback_gets_forges_key_and_none_of_the_clients_headers(
    recording, route, stream
):
    headers = {**CLIENT_HEADERS, "x-request-id": REQUEST_ID}
    async with failing_over(httpx.ASGITransport(recording)) as client:
        answer = await client.post(route, json=body(route, stream), headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-forge-backend"] == "fallback"

    # The upstream gets Forge's own id for the request, not the client's (clients choose theirs;
    # the access log joins the two: ``request_id`` and ``forge_id``).
    (sent,) = [h for h in recording.seen if h.get("x-request-id") is not None]
    assert sent["x-request-id"] != REQUEST_ID
    assert set(sent) <= UPSTREAM_MAY_SEE, set(sent) - UPSTREAM_MAY_SEE
    assert sent["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert sent["user-agent"] != CLIENT_HEADERS["user-agent"]
    client_values = {v for name, v in CLIENT_HEADERS.items() if name != "user-agent"}
    assert not [v for v in sent.values() if any(c in v for c in client_values)]
    # The health probes (GET /v1/models) carry the key too, and nothing of any client's.
    probes = [h for h in recording.seen if h.get("x-request-id") is None]
    assert probes and all(h["authorization"] == f"Bearer {UPSTREAM_KEY}" for h in probes)


class Leak(AssertionError):
    """The upstream key where a client can read it."""


def quoting_the_key(status: int) -> Callable[[httpx.Request], httpx.Response]:
    """An upstream refusing every completion with ``status``, its error quoting the
    Authorization header it was sent, in the message and in the rest of the body."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":  # the health probe
            return httpx.Response(200, json={"object": "list", "data": []})
        sent = request.headers.get("authorization", "")
        error = {
            "message": f"Request refused; you sent Authorization: {sent}",
            "type": "invalid_request_error",
            "code": "refused",
            "param": sent,
        }
        return httpx.Response(status, json={"error": error, "echo": {"authorization": sent}})

    return handler


@pytest.mark.parametrize(
    "status",
    [
        401,
        403,
        429,
        500,
        503,
        400,  # an upstream 4xx about the request is passed on, with the key cut out
        404,
        422,
    ],
)
async def test_an_upstream_error_quoting_the_key_never_shows_it_to_the_client(
    monkeypatch, caplog, status
):
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    serve_logger = logging.getLogger("ray.serve")  # does not propagate to the root
    serve_logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="ray.serve")
    answers = []
    try:
        upstream = httpx.MockTransport(quoting_the_key(status))
        async with failing_over(upstream) as client:
            for stream in (False, True):
                answer = await client.post(
                    "/v1/chat/completions",
                    json=body("/v1/chat/completions", stream),
                    headers={"authorization": f"Bearer {KEY}"},
                )
                assert answer.status_code >= 400, answer.text
                answers.append(answer)
    finally:
        serve_logger.removeHandler(caplog.handler)
    # The gateway's own records of the refusals, whatever reached the client.
    assert caplog.text.count('"request_id":') == 2
    assert UPSTREAM_KEY not in caplog.text
    shown = [a.text + orjson.dumps(dict(a.headers)).decode() for a in answers]
    if leaks := [text for text in shown if UPSTREAM_KEY in text]:
        raise Leak(leaks)
