"""FallbackBackend against an httpx.MockTransport upstream: pass-through, usage, error mapping."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from serve_app import sse
from serve_app.backends.fallback import FallbackBackend
from serve_app.config.models import FallbackConfig
from serve_app.errors import ForgeError

KEY_ENV = "FORGE_TEST_FALLBACK_KEY"
CONFIG = FallbackConfig(base_url="http://upstream.test/v1/", model="gemini-x", api_key_env=KEY_ENV)
CHAT = {"model": "forge-sim", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5}
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}

ROLE = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}],"usage":null}\n\n'
HELLO = b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}],"usage":null}\n\n'
WORLD = b'data: {"choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}\n\n'
USAGE_ONLY = b'data: {"choices":[],"usage":' + orjson.dumps(USAGE) + b"}\n\n"
UPSTREAM = ROLE + HELLO + WORLD + USAGE_ONLY + sse.DONE

Handler = Callable[[httpx.Request], httpx.Response]


class Upstream:
    """Records what the fallback sent; answers with the handler's response."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.handler(request)

    def sent_json(self, i: int = -1) -> dict:
        return orjson.loads(self.requests[i].content)


async def reads(*chunks: bytes) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


def sse_response(*chunks: bytes) -> Handler:
    return lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=reads(*chunks)
    )


@pytest.fixture
async def make_backend(monkeypatch) -> AsyncIterator[Callable[[Handler], tuple]]:
    monkeypatch.setenv(KEY_ENV, "sk-upstream-secret")
    backends: list[FallbackBackend] = []

    def make(handler: Handler, config: FallbackConfig = CONFIG) -> tuple[FallbackBackend, Upstream]:
        upstream = Upstream(handler)
        backend = FallbackBackend(config, transport=httpx.MockTransport(upstream))
        backends.append(backend)
        return backend, upstream

    yield make
    for backend in backends:
        await backend.aclose()


async def batches_of(backend: FallbackBackend, body: dict, kind: str = "chat") -> list[list]:
    return [batch async for batch in backend.stream(body, kind, "req-9")]


def frames(batches: list[list]) -> bytes:
    return b"".join(item for batch in batches for item in batch if type(item) is bytes)


def metadata(batches: list[list]) -> list[dict]:
    return [item for batch in batches for item in batch if isinstance(item, dict)]


async def test_frames_pass_through_unchanged_and_upstream_done_dropped(make_backend):
    backend, _ = make_backend(sse_response(UPSTREAM))
    batches = await batches_of(backend, {**CHAT, "stream": True})
    assert frames(batches) == ROLE + HELLO + WORLD  # no [DONE]: the gateway sends its own
    assert backend.name == "fallback"


async def test_frames_split_and_merged_across_reads_are_reframed(make_backend):
    cut = len(ROLE) + 10
    backend, _ = make_backend(sse_response(UPSTREAM[:cut], UPSTREAM[cut:-3], UPSTREAM[-3:]))
    batches = await batches_of(backend, {**CHAT, "stream": True})
    assert batches[0] == [ROLE]
    assert frames(batches) == ROLE + HELLO + WORLD
    assert metadata(batches) == [{"usage": USAGE}]


async def test_usage_frame_dropped_when_not_asked_but_reported_as_metadata(make_backend):
    backend, _ = make_backend(sse_response(UPSTREAM))
    batches = await batches_of(backend, {**CHAT, "stream": True})
    assert USAGE_ONLY not in frames(batches)
    assert metadata(batches) == [{"usage": USAGE}]


async def test_usage_frame_forwarded_when_client_asked(make_backend):
    backend, _ = make_backend(sse_response(UPSTREAM))
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    batches = await batches_of(backend, body)
    assert frames(batches) == ROLE + HELLO + WORLD + USAGE_ONLY
    assert metadata(batches) == [{"usage": USAGE}]


async def test_usage_on_a_chunk_with_choices_is_forwarded_and_reported(make_backend):
    last = b'data: {"choices":[{"index":0,"delta":{"content":"!"}}],"usage":{"total_tokens":5}}\n\n'
    backend, _ = make_backend(sse_response(HELLO, last, sse.DONE))
    batches = await batches_of(backend, {**CHAT, "stream": True})
    assert frames(batches) == HELLO + last
    assert metadata(batches) == [{"usage": {"total_tokens": 5}}]


async def test_upstream_request_asks_for_usage_with_fallback_model_and_key(make_backend):
    backend, upstream = make_backend(sse_response(UPSTREAM))
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": False}}
    await batches_of(backend, body)
    request = upstream.requests[0]
    assert request.method == "POST"
    assert str(request.url) == "http://upstream.test/v1/chat/completions"
    assert request.headers["authorization"] == "Bearer sk-upstream-secret"
    assert request.headers["x-request-id"] == "req-9"
    assert request.headers["content-type"] == "application/json"
    sent = upstream.sent_json()
    assert sent["model"] == "gemini-x"
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert sent["messages"] == CHAT["messages"] and sent["temperature"] == 0.5
    assert body["stream_options"] == {"include_usage": False}  # the client's body is not mutated
    assert body["model"] == "forge-sim"


async def test_completion_kind_posts_to_completions(make_backend):
    backend, upstream = make_backend(sse_response(b'data: {"choices":[{"text":"x"}]}\n\n'))
    await batches_of(backend, {"model": "forge-sim", "prompt": "p", "stream": True}, "completion")
    assert upstream.requests[0].url.path == "/v1/completions"


async def test_no_auth_sends_no_authorization(make_backend):
    keyless = FallbackConfig(base_url="http://upstream.test/v1/", model="gemini-x")
    assert keyless.auth == "none"
    backend, upstream = make_backend(sse_response(UPSTREAM), keyless)
    await batches_of(backend, {**CHAT, "stream": True})
    assert "authorization" not in upstream.requests[0].headers


def test_a_missing_api_key_secret_stops_the_backend_at_start(monkeypatch):
    """Not a keyless request per call: the deployment fails to start, naming the variable."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=KEY_ENV) as info:
        FallbackBackend(CONFIG)
    assert "fallback.api_key_env" in str(info.value)


class CountingCredentials:
    """A credential that changes every call: proves the header is asked for per request."""

    def __init__(self) -> None:
        self.calls = 0

    async def headers(self) -> dict[str, str]:
        self.calls += 1
        return {"authorization": f"Bearer token-{self.calls}"}

    async def aclose(self) -> None:
        pass


async def test_authorization_is_fetched_per_request_for_stream_complete_and_ready():
    answer = {"id": "x", "object": "chat.completion", "choices": [], "usage": USAGE}

    def handler(request: httpx.Request) -> httpx.Response:
        if b'"stream":true' in request.content:
            return sse_response(UPSTREAM)(request)
        return httpx.Response(200, json=answer)

    upstream, credentials = Upstream(handler), CountingCredentials()
    keyless = FallbackConfig(base_url="http://upstream.test/v1/", model="gemini-x")
    backend = FallbackBackend(
        keyless, transport=httpx.MockTransport(upstream), credentials=credentials
    )
    try:
        await batches_of(backend, {**CHAT, "stream": True})
        await backend.complete(CHAT, "chat", "r")
        assert await backend.ready() is True
    finally:
        await backend.aclose()
    sent = [r.headers["authorization"] for r in upstream.requests]
    assert sent == ["Bearer token-1", "Bearer token-2", "Bearer token-3"]
    assert upstream.requests[2].method == "GET"


async def test_credentials_failure_is_a_502_before_anything_is_sent():
    class Unavailable:
        async def headers(self) -> dict[str, str]:
            raise ForgeError(502, "Fallback credentials unavailable.", type="api_error")

        async def aclose(self) -> None:
            pass

    upstream = Upstream(sse_response(UPSTREAM))
    keyless = FallbackConfig(base_url="http://upstream.test/v1/", model="gemini-x")
    backend = FallbackBackend(
        keyless, transport=httpx.MockTransport(upstream), credentials=Unavailable()
    )
    try:
        for call in (
            batches_of(backend, {**CHAT, "stream": True}),
            backend.complete(CHAT, "chat", "r"),
        ):
            with pytest.raises(ForgeError) as info:
                await call
            assert info.value.status == 502
        assert await backend.ready() is False
        no_probe = FallbackConfig(base_url="http://upstream.test/v1/", model="m", health_path=None)
        keyless = FallbackBackend(no_probe, credentials=Unavailable())
        assert await keyless.ready() is False
        await keyless.aclose()
    finally:
        await backend.aclose()
    assert upstream.requests == []


async def test_upstream_500_is_502(make_backend):
    backend, _ = make_backend(lambda r: httpx.Response(500, content=b"boom"))
    with pytest.raises(ForgeError) as info:
        await batches_of(backend, {**CHAT, "stream": True})
    assert (info.value.status, info.value.code) == (502, "bad_gateway")
    assert "HTTP 500" in info.value.message
    with pytest.raises(ForgeError) as info:
        await backend.complete(CHAT, "chat", "r")
    assert info.value.status == 502


async def test_upstream_400_passes_its_openai_error_on(make_backend):
    error = {
        "error": {"message": "prompt too long", "type": "invalid_request_error", "code": "ctx"}
    }
    backend, _ = make_backend(lambda r: httpx.Response(400, json=error))
    for call in (
        batches_of(backend, {**CHAT, "stream": True}),
        backend.complete(CHAT, "chat", "r"),
    ):
        with pytest.raises(ForgeError) as info:
            await call
        err = info.value
        assert (err.status, err.message, err.type, err.code) == (
            400,
            "prompt too long",
            "invalid_request_error",
            "ctx",
        )


async def test_upstream_4xx_without_openai_body_gets_a_generic_message(make_backend):
    backend, _ = make_backend(lambda r: httpx.Response(422, content=b"<html>nope</html>"))
    with pytest.raises(ForgeError) as info:
        await backend.complete(CHAT, "chat", "r")
    assert info.value.status == 422
    assert info.value.message == "The fallback model rejected the request (HTTP 422)."
    assert info.value.type == "invalid_request_error"


def raising(exc_type: type[httpx.HTTPError]) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc_type("simulated", request=request)

    return handler


@pytest.mark.parametrize(
    ("exc_type", "status", "code"),
    [
        (httpx.ConnectError, 502, "bad_gateway"),
        (httpx.ConnectTimeout, 504, "upstream_timeout"),
        (httpx.ReadTimeout, 504, "upstream_timeout"),
    ],
)
async def test_transport_failures_map_to_5xx(make_backend, exc_type, status, code):
    backend, _ = make_backend(raising(exc_type))
    for call in (
        batches_of(backend, {**CHAT, "stream": True}),
        backend.complete(CHAT, "chat", "r"),
    ):
        with pytest.raises(ForgeError) as info:
            await call
        assert (info.value.status, info.value.code) == (status, code)


@pytest.mark.parametrize(
    ("exc", "status"),
    [(httpx.ReadError("reset"), 502), (httpx.ReadTimeout("stalled"), 504)],
)
async def test_stream_breaking_midway_raises_after_the_first_batch(make_backend, exc, status):
    async def broken() -> AsyncIterator[bytes]:
        yield HELLO
        raise exc

    backend, _ = make_backend(lambda r: httpx.Response(200, content=broken()))
    stream = backend.stream({**CHAT, "stream": True}, "chat", "r")
    assert await anext(stream) == [HELLO]
    with pytest.raises(ForgeError) as info:
        await anext(stream)
    assert info.value.status == status


async def test_an_event_past_the_frame_cap_ends_the_stream_with_a_502(make_backend):
    """An upstream that never ends its event is cut once it passes ``sse.MAX_FRAME_BYTES``
    (the relay then sends an SSE error event), instead of growing the gateway's memory."""

    async def endless() -> AsyncIterator[bytes]:
        yield HELLO
        for _ in range(sse.MAX_FRAME_BYTES // 65536 + 2):
            yield b"x" * 65536

    backend, _ = make_backend(lambda r: httpx.Response(200, content=endless()))
    stream = backend.stream({**CHAT, "stream": True}, "chat", "r")
    assert await anext(stream) == [HELLO]
    with pytest.raises(ForgeError) as info:
        await anext(stream)
    assert info.value.status == 502 and "bytes" in info.value.message


async def test_complete_returns_response_and_no_replica(make_backend):
    answer = {"id": "x", "object": "chat.completion", "choices": [], "usage": USAGE}
    backend, upstream = make_backend(lambda r: httpx.Response(200, json=answer))
    result = await backend.complete({**CHAT, "stream": False}, "chat", "req-9")
    assert result == {"response": answer, "replica": None}
    sent = upstream.sent_json()
    assert sent["model"] == "gemini-x" and sent["stream"] is False
    assert "stream_options" not in sent
    assert upstream.requests[0].headers["authorization"] == "Bearer sk-upstream-secret"


async def test_complete_with_invalid_json_is_502(make_backend):
    backend, _ = make_backend(lambda r: httpx.Response(200, content=b"not json"))
    with pytest.raises(ForgeError) as info:
        await backend.complete(CHAT, "chat", "r")
    assert info.value.status == 502


async def test_ready_reflects_models_endpoint(make_backend):
    ok, upstream = make_backend(lambda r: httpx.Response(200, json={"data": []}))
    assert await ok.ready() is True
    assert upstream.requests[0].url.path == "/v1/models"
    assert upstream.requests[0].headers["authorization"] == "Bearer sk-upstream-secret"
    down, _ = make_backend(lambda r: httpx.Response(503))
    assert await down.ready() is False
    gone, _ = make_backend(raising(httpx.ConnectError))
    assert await gone.ready() is False


async def test_ready_gets_the_configured_health_path(make_backend):
    config = CONFIG.model_copy(update={"health_path": "health/live"})
    backend, upstream = make_backend(lambda r: httpx.Response(200), config)
    assert await backend.ready() is True
    assert upstream.requests[0].url.path == "/v1/health/live"


async def test_ready_without_a_health_path_checks_only_the_credentials(make_backend):
    """Vertex AI's endpoint has nothing to GET: probing it would fail and open the breaker."""
    config = CONFIG.model_copy(update={"health_path": None})
    backend, upstream = make_backend(lambda r: httpx.Response(404), config)
    assert await backend.ready() is True
    assert upstream.requests == []


@pytest.mark.parametrize(("status", "expected"), [(401, 502), (403, 502), (429, 503)])
async def test_upstream_refusing_forge_itself_is_a_backend_failure(make_backend, status, expected):
    """Our credentials or our provider quota are not the client's fault: 5xx, failover-able."""
    backend, _ = make_backend(lambda request: httpx.Response(status, json={"error": {}}))
    with pytest.raises(ForgeError) as info:
        await batches_of(backend, CHAT)
    assert info.value.status == expected


async def test_done_without_a_space_is_still_dropped(make_backend):
    backend, _ = make_backend(sse_response(HELLO, b"data:[DONE]\n\n"))
    assert frames(await batches_of(backend, CHAT)) == HELLO


async def test_a_malformed_usage_frame_is_a_clean_502(make_backend):
    broken = b'data: {"choices":[],"usage":{"prompt_tokens": 3\n\n'
    backend, _ = make_backend(sse_response(HELLO, broken))
    with pytest.raises(ForgeError) as info:
        await batches_of(backend, CHAT)
    assert info.value.status == 502


FALLBACKS_YAML = Path(__file__).resolve().parents[2] / "configs" / "fallbacks.yaml"


def test_the_shipped_real_fallbacks_validate():
    """configs/fallbacks.yaml is copied into deployments: both blocks must stay valid."""
    blocks = yaml.safe_load(FALLBACKS_YAML.read_text())
    gemini = FallbackConfig.model_validate(blocks["gemini"])
    assert (gemini.auth, gemini.api_key_env) == ("api_key", "GEMINI_API_KEY")
    assert gemini.base_url == "https://generativelanguage.googleapis.com/v1beta/openai/"
    vertex = FallbackConfig.model_validate(blocks["vertex_ai"])
    assert (vertex.auth, vertex.api_key_env, vertex.model) == (
        "gcp_metadata",
        None,
        "google/gemini-3.8-flash",
    )
    assert vertex.base_url.endswith("/endpoints/openapi")
    assert vertex.health_path is None
