"""Telemetry: every outcome becomes one clean response, one metrics record and one access log
line, and a stream is recorded when it ends (499 if the client left, 599 if it ended with an
SSE error event), not when it starts."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator

import orjson
import pytest
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from serve_app import errors
from serve_app.config.models import TenantConfig
from serve_app.pipeline import EventStream, RequestContext
from serve_app.stages.telemetry import TelemetryStage
from tests.doubles import RecordingMetrics, chunk, make_ctx

API_KEY = "sk-forge-test-SECRET-0123456789"


@pytest.fixture
def metrics() -> RecordingMetrics:
    return RecordingMetrics()


@pytest.fixture
def stage(metrics: RecordingMetrics) -> TelemetryStage:
    return TelemetryStage(metrics)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture):
    """Serve's logger does not propagate to the root: capture at it, access lines included."""
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="ray.serve.forge.access")
    yield caplog
    serve_logger.removeHandler(caplog.handler)


def request_ctx(stream: bool = True) -> RequestContext:
    """A chat request from tenant ``acme``, with its API key in the Authorization header."""
    ctx = make_ctx(stream=stream)
    ctx.request = Request(
        {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [(b"authorization", f"Bearer {API_KEY}".encode())],
        }
    )
    ctx.tenant = TenantConfig(name="acme")
    return ctx


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [
        json.loads(r.getMessage()) for r in caplog.records if r.name == "ray.serve.forge.access"
    ]


def event_stream(ctx: RequestContext, parts: list[bytes], *, error: str | None = None):
    """What dispatch returns for a stream: frames, then (if ``error``) an SSE error event."""

    async def content() -> AsyncIterator[bytes]:
        for part in parts:
            yield part
        if error is not None:
            ctx.stream_error = error
            yield errors.error_event(errors.bad_gateway(error))

    async def close_source() -> None:
        return None

    return EventStream(content(), close_source=close_source, headers={})


async def drive(response: Response, metrics: RecordingMetrics, *, leave_after: int | None = None):
    """Send ``response`` as Starlette's server would; the client leaves after ``leave_after``
    body chunks if given. Returns the messages sent and how many records existed at each."""
    sent: list[dict] = []
    records_seen: list[int] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        records_seen.append(len(metrics.recorded))
        bodies = sum(m["type"] == "http.response.body" for m in sent)
        if leave_after is not None and message["type"] == "http.response.body":
            if bodies >= leave_after:
                raise OSError("client went away")
        sent.append(message)

    with contextlib.suppress(ClientDisconnect):
        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
    return sent, records_seen


# -- errors ----------------------------------------------------------------------------------


async def test_a_forge_error_becomes_its_openai_response_and_is_recorded_with_its_status(
    stage, metrics, logs
):
    err = errors.rate_limited(
        "Tenant acme is over its limit.", kind="requests", headers={"retry-after": "3"}
    )

    async def endpoint(ctx):
        raise err

    ctx = request_ctx(stream=False)
    response = await stage(ctx, endpoint)

    assert response.status_code == 429
    assert response.headers["retry-after"] == "3"
    assert orjson.loads(response.body) == {
        "error": {
            "message": "Tenant acme is over its limit.",
            "type": "requests",
            "code": "rate_limit_exceeded",
            "param": None,
        }
    }
    assert len(metrics.recorded) == 1
    assert metrics.recorded[0]["status"] == 429
    assert metrics.recorded[0]["tenant"] == "acme"
    assert metrics.recorded[0]["route"] == "chat"
    [line] = access_lines(logs)
    assert line["status"] == 429


async def test_an_unexpected_exception_is_a_clean_500_and_its_trace_stays_in_the_log(
    stage, metrics, logs
):
    async def endpoint(ctx):
        raise RuntimeError("bug at /srv/forge/secret_module.py line 42")

    ctx = request_ctx(stream=False)
    response = await stage(ctx, endpoint)

    assert response.status_code == 500
    assert orjson.loads(response.body) == errors.internal_error().body()
    assert b"secret_module" not in response.body and b"Traceback" not in response.body
    assert [r["status"] for r in metrics.recorded] == [500]
    # The operator finds the trace by the request id.
    [logged] = [r for r in logs.records if r.exc_info is not None]
    assert "req-1" in logged.getMessage()
    assert isinstance(logged.exc_info[1], RuntimeError)


# -- streams ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status"),
    [(None, 200), ("The model replica failed.", 599)],
    ids=["clean-end", "ended-with-an-error-event"],
)
async def test_a_stream_is_recorded_once_when_it_ends(stage, metrics, logs, error, status):
    ctx = request_ctx()

    async def endpoint(c):
        return event_stream(c, [chunk("Hel"), chunk("lo")], error=error)

    response = await stage(ctx, endpoint)
    assert response.status_code == 200  # the status line went out before any failure
    assert metrics.recorded == []  # started, not ended

    sent, records_seen = await drive(response, metrics)

    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert set(records_seen) == {0}  # nothing was recorded while bytes were still going out
    assert [r["status"] for r in metrics.recorded] == [status]
    assert [line["status"] for line in access_lines(logs)] == [status]


async def test_a_stream_the_client_abandons_is_recorded_once_as_499(stage, metrics, logs):
    ctx = request_ctx()

    async def endpoint(c):
        return event_stream(c, [chunk(str(i)) for i in range(10)])

    response = await stage(ctx, endpoint)
    assert metrics.recorded == []

    sent, _ = await drive(response, metrics, leave_after=2)

    assert sum(m["type"] == "http.response.body" for m in sent) == 2  # it did leave mid-stream
    assert [r["status"] for r in metrics.recorded] == [499]
    assert [line["status"] for line in access_lines(logs)] == [499]


# -- the access log --------------------------------------------------------------------------


async def test_the_access_line_names_the_request_and_never_the_key(stage, metrics, logs):
    ctx = request_ctx(stream=False)

    async def endpoint(c):
        c.backend = "primary"
        c.usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        return Response(b"{}", media_type="application/json")

    await stage(ctx, endpoint)

    [line] = access_lines(logs)
    assert line["request_id"] == "req-1"
    assert line["tenant"] == "acme"
    assert line["status"] == 200
    assert line["backend"] == "primary"
    assert (line["prompt_tokens"], line["completion_tokens"]) == (5, 2)
    assert API_KEY not in logs.text
    assert "authorization" not in logs.text.lower()
