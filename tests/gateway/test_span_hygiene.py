"""No key, prompt or answer in any span, nor in any log record: the gateway wired in process (its
real stages, replicas, engines, cache and fallback client; ``serve_app/local.py``) with an
in-memory span exporter, after traffic that carries marker strings.

The markers: one in an API key (refused), one in the prompt (of chats, completions and
embeddings, served and refused), one in the answer (the simulated model fills a JSON-schema
property and a tool argument from their enums, so the generated text carries a string the
prompt does not). The traffic takes every path: served, streamed, from the cache, refused by
the gateway (401, 400, 413) and by the replica (400), served by the fallback after the pool
failed, and a stream that broke after its first byte. Every span's name, attributes, events,
links and status are searched, and every log record of Forge's loggers (Serve's, which does not
propagate to the root, and the root's), tracebacks included. The same check over a real Ray
session's log files and metrics is ``tests/e2e/test_log_hygiene.py``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import httpx
import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from serve_app.config.models import load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.mock_openai import create_mock_app
from tests.gateway.test_server import FAST, KEY, KEY_ENV, MODEL, UPSTREAM_KEY, forge_args
from tests.hygiene import marked
from tests.polling import eventually_async

KEY_MARK = "keymark7f3a9c1e"
PROMPT_MARK = "promptmark52d08b6a"
ANSWER_MARK = "answermark9e41c7d3"
MARKERS = (KEY_MARK, PROMPT_MARK, ANSWER_MARK, KEY, UPSTREAM_KEY)
EMBED_MODEL = "forge-embed"
MESSAGES, TAGGED, LOOKUP = marked(PROMPT_MARK, ANSWER_MARK)
ANSWERS = ({"response_format": TAGGED}, {"tools": [LOOKUP], "tool_choice": "required"})


def args() -> dict:
    """tests/gateway/test_server.py's graph (a 4 KiB body limit) and an embedding pool."""
    base = forge_args()
    # Decoding takes a moment, so a stream's first frames reach the client before it breaks.
    primary = {**base["pools"][0], "engine": {**FAST, "decode_base_s": 0.002}}
    embed = {
        "name": "embed",
        "model": EMBED_MODEL,
        "task": "embed",
        "engine": {**FAST, "embedding_dim": 16, "max_model_len": 256},
    }
    return {**base, "pools": [primary, embed]}


@dataclass
class Seen:
    spans: tuple[ReadableSpan, ...]
    logs: str  # every record, formatted with its traceback
    inference: int  # requests of the inference routes


class Client:
    """The gateway's HTTP surface in process; counts what it sent."""

    def __init__(self, gateway: Gateway) -> None:
        transport = httpx.ASGITransport(gateway.asgi_app())
        self.http = httpx.AsyncClient(transport=transport, base_url="http://forge.test")
        self.inference = 0  # requests of the inference routes: the pipeline traces and logs them

    async def send(
        self,
        path: str,
        body: dict | bytes | None,
        *,
        status: int,
        key: str = KEY,
        method: str = "POST",
    ) -> httpx.Response:
        raw = body if isinstance(body, bytes) else None
        response = await self.http.request(
            method,
            path,
            json=None if raw is not None else body,
            content=raw,
            headers={"authorization": f"Bearer {key}"},
        )
        self.inference += path.startswith("/v1/") and path != "/v1/usage"
        assert response.status_code == status, (path, response.status_code, response.text)
        return response

    async def chat(self, *, status: int = 200, **extra) -> httpx.Response:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, **extra}
        return await self.send("/v1/chat/completions", body, status=status)


def answer_text(response: httpx.Response) -> str:
    """The generated text and tool-call arguments, a stream's pieces joined."""
    if not response.headers["content-type"].startswith("text/event-stream"):
        return response.text
    pieces = []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            for choice in orjson.loads(line[6:]).get("choices", ()):
                delta = choice.get("delta") or {}
                pieces.append(delta.get("content") or "")
                for call in delta.get("tool_calls") or ():
                    pieces.append((call.get("function") or {}).get("arguments") or "")
    return "".join(pieces)


async def drive(client: Client, gateway: Gateway) -> None:
    for stream in (False, True):
        for extra in ANSWERS:
            answer = await client.chat(stream=stream, temperature=0, **extra)
            assert ANSWER_MARK in answer_text(answer)

    async def repeat() -> httpx.Response | None:
        answer = await client.chat(response_format=TAGGED, temperature=0)
        return answer if answer.headers.get("x-forge-cache") == "hit" else None

    for _ in range(50):  # the entry is written once the first answer has ended
        if hit := await repeat():
            break
    else:
        raise AssertionError("a temperature-0 repeat never became a cache hit")
    assert ANSWER_MARK in answer_text(hit)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": PROMPT_MARK, "max_tokens": 8, "stream": stream}
        await client.send("/v1/completions", body, status=200)
    embed = {"model": EMBED_MODEL, "input": [PROMPT_MARK, f"and {PROMPT_MARK}"]}
    await client.send("/v1/embeddings", embed, status=200)

    bad_key = f"sk-forge-{KEY_MARK}"
    for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
        body = None if method == "GET" else {"model": MODEL, "messages": MESSAGES}
        refused = await client.send(path, body, status=401, key=bad_key, method=method)
        assert KEY_MARK not in refused.text
    await client.send("/v1/usage", None, status=401, key=bad_key, method="GET")
    await client.send("/admin/usage", None, status=401, key=bad_key, method="GET")
    await client.chat(status=400, max_tokens=0)
    await client.chat(status=400, messages=[{"role": "wizard", "content": PROMPT_MARK}])
    cut = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "{PROMPT_MARK}'
    await client.send("/v1/chat/completions", cut.encode(), status=400)
    await client.send(
        "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES * 80}, status=413
    )
    for stream in (False, True):
        await client.chat(status=400, stream=stream, max_tokens=1_000_000)

    replicas = gateway.backends["primary"].replicas.values()
    for replica in replicas:  # breaks after its first frames: an SSE error event, not a retry
        replica.set_fault({"mode": "die_mid_stream", "after_frames": 5, "exit_process": False})
    broken = await client.chat(stream=True)
    assert '"error"' in broken.text.rsplit("data: ", 1)[-1]
    assert broken.headers["x-forge-backend"] == "primary"
    for replica in replicas:
        replica.set_fault({"mode": "error"})
    for stream in (False, True):
        for extra in ANSWERS:
            answer = await client.chat(stream=stream, **extra)
            assert answer.headers["x-forge-backend"] == "fallback"
            assert ANSWER_MARK in answer_text(answer)


@contextlib.asynccontextmanager
async def traced_gateway(
    upstream: httpx.AsyncBaseTransport,
) -> AsyncIterator[tuple[Gateway, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    gateway = build_local_gateway(
        load_config(args()), fallback_transport=upstream, tracer=provider.get_tracer("forge")
    )
    async with gateway.lifespan():
        yield gateway, exporter


@pytest.fixture
async def seen(monkeypatch, caplog) -> AsyncIterator[Seen]:
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    upstream = httpx.ASGITransport(create_mock_app("mock-gemini", FAST, api_key=UPSTREAM_KEY))
    serve_logger = logging.getLogger("ray.serve")  # does not propagate to the root
    serve_logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="ray.serve")
    try:
        async with traced_gateway(upstream) as (gateway, exporter):
            client = Client(gateway)
            await drive(client, gateway)
            # A stream's spans end with its response, a moment after its last byte. (The usage
            # and admin routes are neither traced nor access-logged by the pipeline.)
            await eventually_async(
                lambda: roots(exporter.get_finished_spans()) == client.inference,
                timeout_s=5,
                what=f"a forge.request span for each of the {client.inference} inference requests",
                explain=lambda: roots(exporter.get_finished_spans()),
            )
            spans = exporter.get_finished_spans()
            yield Seen(spans, caplog.text, client.inference)
    finally:
        serve_logger.removeHandler(caplog.handler)


def roots(spans: Iterable[ReadableSpan]) -> int:
    return sum(s.name == "forge.request" for s in spans)


def texts(span: ReadableSpan) -> list[str]:
    """Every string a span exports: its name, attributes, events, links, status and resource."""
    values: list[object] = [span.name, span.status.description]
    for attributes in (
        span.attributes,
        span.resource.attributes,
        *(e.attributes for e in span.events),
        *(link.attributes for link in span.links),
    ):
        for name, value in (attributes or {}).items():
            values += [name, *(value if isinstance(value, tuple | list) else [value])]
    values += [e.name for e in span.events]
    return [v for v in values if isinstance(v, str)]


def leaks_in(spans: Iterable[ReadableSpan], markers: Iterable[str]) -> set[tuple[str, str]]:
    return {
        (span.name, text[:200])
        for span in spans
        for text in texts(span)
        for marker in markers
        if marker in text
    }


async def test_no_span_carries_a_key_a_prompt_or_an_answer(seen: Seen):
    names = {s.name for s in seen.spans}
    # The spans looked at are the ones that saw the markers: the replicas', the dispatch
    # attempts (the fallback's too) and every refusal's root.
    assert {"forge.replica.generate", "forge.dispatch", "forge.auth", "forge.parse"} <= names
    statuses = {s.attributes.get("http.response.status_code") for s in seen.spans}
    assert {200, 400, 401, 413} <= statuses
    assert not leaks_in(seen.spans, MARKERS)


async def test_no_log_record_of_the_same_traffic_carries_them(seen: Seen):
    # The records looked at are the requests' own: an access line per inference request.
    assert seen.logs.count('"request_id":') == seen.inference
    assert '"error":"' in seen.logs  # the stream that broke, with its error
    leaks = {marker for marker in MARKERS if marker in seen.logs}
    assert not leaks, [line for line in seen.logs.splitlines() if any(m in line for m in leaks)]


class Leak(AssertionError):
    """A marker found in a span."""


def quoting_upstream(request: httpx.Request) -> httpx.Response:
    """An upstream whose 400 quotes the request it refuses, as validation errors often do."""
    if request.method == "GET":  # the health probe
        return httpx.Response(200, json={"object": "list", "data": []})
    said = orjson.loads(request.content)["messages"][0]["content"]
    error = {"message": f"Invalid value: {said!r}.", "type": "invalid_request_error"}
    return httpx.Response(400, json={"error": error})


@pytest.mark.parametrize("where", ["replica", "fallback"])
async def test_an_error_that_quotes_the_request_stays_out_of_the_spans(monkeypatch, where):
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    async with traced_gateway(httpx.MockTransport(quoting_upstream)) as (gateway, exporter):
        client = Client(gateway)
        if where == "replica":
            # vLLM's 400 (and the simulator's, in its words) quotes a tool_choice it refuses.
            refused = await client.chat(status=400, tools=[LOOKUP], tool_choice=PROMPT_MARK)
        else:
            for replica in gateway.backends["primary"].replicas.values():
                replica.set_fault({"mode": "error"})
            refused = await client.chat(status=400)
        assert PROMPT_MARK in refused.text  # the client's own text, back to the client: fine
        await eventually_async(
            lambda: roots(exporter.get_finished_spans()) == 1,
            timeout_s=5,
            what="the request's span",
        )
        if leaks := leaks_in(exporter.get_finished_spans(), [PROMPT_MARK]):
            raise Leak(leaks)
