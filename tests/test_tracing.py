"""Traces: one per request, a span per stage in order, the tenant on the root, the context carried
into the replica and as ``traceparent`` to the fallback, the client's own trace continued, and
no prompt text anywhere. The gateway is wired in process (the real stages, replicas and fallback
client) with an in-memory exporter."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serve_app import tracing
from serve_app.config.models import TracingConfig, load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.mock_openai import create_mock_app
from serve_app.tracing import tracer_for
from tests.backends.loopback import RecordingHeaders
from tests.gateway.test_server import FAST, KEY, KEY_ENV, MODEL, UPSTREAM_KEY, forge_args

PROMPT = "a secret prompt the traces must never carry"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"
STAGES = [
    "forge.requestid",
    "forge.telemetry",
    "forge.auth",
    "forge.meter",
    "forge.parse",
    "forge.quota",
    "forge.cache",
]


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def upstream() -> RecordingHeaders:
    return RecordingHeaders(create_mock_app("mock-gemini", FAST, api_key=UPSTREAM_KEY))


@pytest.fixture
async def gateway(monkeypatch, exporter, upstream) -> AsyncIterator[Gateway]:
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gateway = build_local_gateway(
        load_config(forge_args()),
        fallback_transport=httpx.ASGITransport(upstream),
        tracer=provider.get_tracer("forge"),
    )
    async with gateway.lifespan():
        yield gateway


async def post(gateway: Gateway, *, stream: bool, traceparent: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}"}
    if traceparent:
        headers["traceparent"] = traceparent
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4,
        "stream": stream,
    }
    transport = httpx.ASGITransport(gateway.asgi_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://forge.test") as client:
        response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200
    return response


@pytest.mark.parametrize("stream", [False, True])
async def test_one_trace_per_request_with_the_stages_in_order(gateway, exporter, stream):
    await post(gateway, stream=stream)
    spans = exporter.get_finished_spans()
    assert len({s.context.trace_id for s in spans}) == 1
    (root,) = [s for s in spans if s.name == "forge.request"]
    assert root.parent is None
    stages = sorted(
        (s for s in spans if s.parent and s.parent.span_id == root.context.span_id),
        key=lambda s: s.start_time,
    )
    assert [s.name for s in stages] == [*STAGES, "forge.admission", "forge.dispatch"]
    # Each stage's span ends when it hands on: they follow one another.
    for before, after in itertools.pairwise(stages):
        assert before.end_time <= after.start_time
    assert root.attributes["forge.tenant"] == "alpha"
    assert root.attributes["forge.model"] == MODEL
    assert root.attributes["forge.backend"] == "primary"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["forge.completion_tokens"] <= 4
    dispatch = stages[-1]
    (generate,) = [s for s in spans if s.name == "forge.replica.generate"]
    assert generate.parent.span_id == dispatch.context.span_id
    assert generate.attributes["forge.replica"] == root.attributes["forge.replica"]
    assert [e.name for e in dispatch.events] == ["forge.attempt"]


async def test_the_clients_trace_is_continued(gateway, exporter):
    await post(gateway, stream=True, traceparent=CLIENT_TRACEPARENT)
    spans = exporter.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in spans} == {CLIENT_TRACE}


async def test_traceparent_reaches_the_fallback_and_no_prompt_text_is_in_any_span(
    gateway, exporter, upstream
):
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "error"})
    response = await post(gateway, stream=True)
    assert response.headers["x-forge-backend"] == "fallback"
    spans = exporter.get_finished_spans()
    trace_id = format(spans[0].context.trace_id, "032x")
    sent = [h.get("traceparent") for h in upstream.seen if h.get("x-request-id")]
    assert sent and all(tp and tp.split("-")[1] == trace_id for tp in sent)
    dispatch = next(s for s in spans if s.name == "forge.dispatch")
    events = [(e.name, e.attributes.get("backend")) for e in dispatch.events]
    assert ("forge.attempt_failed", "primary") in events
    assert events[-1] == ("forge.attempt", "fallback")
    for span in spans:
        values = [*span.attributes.values()]
        values += [v for e in span.events for v in e.attributes.values()]
        assert not any(isinstance(v, str) and "secret prompt" in v for v in values), span.name
        assert not any(isinstance(v, str) and KEY in v for v in values), span.name


def test_nothing_is_traced_without_an_otlp_endpoint():
    assert tracer_for(TracingConfig(), "forge-test", environ={}) is None
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}
    assert tracer_for(TracingConfig(), "forge-test", environ=endpoint) is not None
    tracing._providers.pop("forge-test").shutdown()
