"""The open-loop traffic generator: its bookkeeping, and one run over a real socket.

The server is the mock OpenAI backend (the simulated engine's real chunks) behind a small ASGI
double of the gateway that says who served (``x-forge-backend``) and, per API key, refuses
(429), cuts a stream short (no ``[DONE]``), ends one with an SSE error event, or stalls.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from collections.abc import Iterator

import orjson
import pytest
import uvicorn

from loadtest.traffic import (
    DROPPED,
    Result,
    Stream,
    prompt_of,
    read_jsonl,
    run,
    summarize,
    write_jsonl,
)
from serve_app.mock_openai import create_mock_app
from serve_app.tokenizer import count_tokens
from tests.polling import eventually


def result(**kw) -> Result:
    base = dict(
        stream="s",
        start=0.0,
        status=200,
        backend="primary",
        cache="miss",
        request_id="r",
        ttft=0.1,
        total=1.0,
        prompt_tokens=10,
        completion_tokens=10,
        truncated=False,
        error=None,
    )
    return Result(**(base | kw))


# -- bookkeeping ------------------------------------------------------------------------------


def test_tpot_is_time_after_the_first_token_per_later_token():
    assert result(ttft=0.1, total=1.0, completion_tokens=10).tpot() == pytest.approx(0.1)
    assert result(completion_tokens=1).tpot() is None
    assert result(completion_tokens=None).tpot() is None
    assert result(ttft=None).tpot() is None


def test_summarize_counts_errors_truncation_and_drops_apart():
    results = [
        result(start=0.0, total=1.0, backend="primary"),
        result(start=1.0, total=2.0, backend="fallback"),
        result(start=2.0, total=9.0, truncated=True, error="no_done"),
        result(start=3.0, status=429, backend=None, error="http_429", ttft=None),
        result(start=4.0, status=0, backend=None, error="transport", ttft=None),
        result(start=4.5, status=0, backend=None, error=DROPPED, ttft=None, total=0.0),
        result(stream="other", start=9.0),
    ]
    s = summarize(results, "s")
    assert s["requests"] == 5 and s["dropped"] == 1
    assert s["ok"] == 3 and s["errors"] == 2 and s["error_ratio"] == pytest.approx(0.4)
    assert s["truncated"] == 1 and s["truncation_ratio"] == pytest.approx(1 / 3)
    assert s["failed"] == 3
    assert s["by_backend"] == {"primary": 2, "fallback": 1, "none": 2}
    assert s["by_status"] == {0: 1, 200: 3, 429: 1}
    assert s["by_error"] == {"no_done": 1, "http_429": 1, "transport": 1}
    # Latency over complete 200s only: the truncated 9 s does not count.
    assert s["total_p95_s"] == 2.0 and s["total_p50_s"] in (1.0, 2.0)
    assert s["req_per_s"] == pytest.approx(5 / 4.0)
    assert summarize(results)["requests"] == 6


def test_summarize_of_nothing_is_json_safe():
    s = summarize([])
    assert s["requests"] == 0 and s["ttft_p50_s"] is None and s["error_ratio"] == 0.0
    orjson.dumps(s)  # no NaN


def test_jsonl_round_trip(tmp_path):
    results = [result(), result(stream="b", status=503, error="http_503", backend=None)]
    path = tmp_path / "sub" / "r.jsonl"
    write_jsonl(results, path)
    assert read_jsonl(path) == results
    assert len(path.read_text().splitlines()) == 2


def test_prompt_of_has_the_token_count_and_differs_per_salt_from_the_first_token():
    for n in (1, 2, 128, 1024):
        assert count_tokens(prompt_of(n, "x")) == n
    a, b = prompt_of(64, "a"), prompt_of(64, "b")
    assert a != b and a.split()[0] != b.split()[0]  # no shared prefix for a prefix cache
    assert prompt_of(64, "a") == a  # deterministic
    assert prompt_of(0) == ""


# -- a run over a real socket ------------------------------------------------------------------

MODEL = "mock-sim"
ENGINE = {"output_tokens_min": 4, "output_tokens_max": 8}


def gateway_double():
    mock = create_mock_app(MODEL, ENGINE)

    async def respond(send, status: int, headers: list, chunks: list[bytes]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def app(scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await mock(scope, receive, send)
        key = dict(scope["headers"]).get(b"authorization", b"").removeprefix(b"Bearer ")
        sse = [(b"content-type", b"text/event-stream"), (b"x-forge-backend", b"primary")]
        content = b'data: {"choices":[{"index":0,"delta":{"content":" hi"}}]}\n\n'
        if key == b"limited":
            body = b'{"error": {"message": "slow down", "type": "rate_limit", "code": null}}'
            return await respond(send, 429, [(b"content-type", b"application/json")], [body])
        if key == b"cut":  # a stream that just stops: no finish_reason, no [DONE]
            return await respond(send, 200, sse, [content])
        if key == b"broken":  # Forge's honest end after the first byte
            error = b'data: {"error": {"message": "upstream died", "type": "server_error"}}\n\n'
            return await respond(send, 200, sse, [content, error, b"data: [DONE]\n\n"])
        if key == b"stall":
            # The behaviour under test: a server silent past the client's 0.3 s timeout. A
            # bounded sleep, not a hang, so that uvicorn can still shut down.
            await asyncio.sleep(1.0)
            return await respond(send, 200, sse, [content])
        backend = b"fallback" if key == b"fallback" else b"primary"

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                extra = [(b"x-forge-backend", backend), (b"x-request-id", b"req-" + key)]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await mock(scope, receive, send_with_headers)

    return app


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(gateway_double(), log_level="warning", lifespan="off", access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    eventually(lambda: server.started, timeout_s=10, what="uvicorn to start")
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def stream(name: str, key: str, rate: float = 20.0, **kw) -> Stream:
    return Stream(name=name, key=key, rate=rate, prompt_tokens=16, max_tokens=8, **kw)


async def test_run_records_backends_tokens_and_failures(base_url, capsys):
    streams = [
        stream("primary", "primary"),
        stream("fallback", "fallback", stream=False),
        stream("limited", "limited", rate=10.0),
        stream("cut", "cut", rate=5.0),
        stream("broken", "broken", rate=5.0),
        stream("late", "primary", rate=20.0, start_s=0.6, end_s=0.9),
    ]
    seen: list[Result] = []
    results = await run(base_url, streams, 1.2, seed=7, progress=True, on_result=seen.append)
    assert sorted(seen, key=lambda r: r.start) == results
    by = {s.name: [r for r in results if r.stream == s.name] for s in streams}
    assert all(by.values()), {k: len(v) for k, v in by.items()}

    for r in by["primary"] + by["fallback"]:
        assert (r.status, r.error, r.truncated) == (200, None, False), r
        assert r.request_id == f"req-{r.stream}"
        assert r.prompt_tokens and r.prompt_tokens >= 16
        assert 4 <= r.completion_tokens <= 8
        assert 0 < r.ttft <= r.total
    assert {r.backend for r in by["primary"]} == {"primary"}
    assert {r.backend for r in by["fallback"]} == {"fallback"}
    assert all(r.tpot() is not None for r in by["primary"])

    assert {(r.status, r.error, r.backend) for r in by["limited"]} == {(429, "http_429", None)}
    assert {(r.status, r.truncated, r.error) for r in by["cut"]} == {(200, True, "no_done")}
    assert {(r.truncated, r.error) for r in by["broken"]} == {(True, "error_event")}
    # Scheduled inside [0.6, 0.9); sent then, or later by the event loop's lag (CI, loaded,
    # saw a send past 0.95 s), never before.
    assert all(0.6 <= r.start < 0.9 + 0.5 for r in by["late"])

    s = summarize(results)
    assert s["requests"] == len(results) and s["dropped"] == 0
    assert s["errors"] == len(by["limited"])
    assert s["truncated"] == len(by["cut"]) + len(by["broken"])
    err = capsys.readouterr().err
    assert "\r[" in err and err.endswith("\n") and "primary" in err


async def test_same_seed_same_arrivals(base_url):
    streams = [stream("a", "primary", rate=15.0), stream("b", "fallback", rate=5.0)]
    one = await run(base_url, streams, 0.4, seed=3)
    two = await run(base_url, streams, 0.4, seed=3)
    # The same arrivals per stream (their order in the list is completion order: timing's).
    assert Counter(r.stream for r in one) == Counter(r.stream for r in two)
    other = await run(base_url, streams, 0.4, seed=4)
    assert [round(r.start, 1) for r in other] != [round(r.start, 1) for r in one]


async def test_timeouts_and_the_in_flight_bound(base_url):
    streams = [stream("stall", "stall", rate=30.0, max_in_flight=2)]
    results = await run(base_url, streams, 0.5, timeout_s=0.3)
    sent = [r for r in results if r.error != DROPPED]
    dropped = [r for r in results if r.error == DROPPED]
    assert sent and dropped
    assert {(r.status, r.error) for r in sent} == {(0, "timeout")}
    assert all(r.total < 1.0 for r in sent)
    assert summarize(results)["dropped"] == len(dropped)


async def test_an_explicit_model_and_headers_are_sent(base_url):
    streams = [stream("p", "primary", model=MODEL, headers={"cache-control": "no-cache"})]
    results = await run(base_url, streams, 0.3, seed=1)
    assert results and all(r.error is None for r in results)
    wrong = [stream("p", "primary", model="no-such-model")]
    results = await run(base_url, wrong, 0.3, seed=1)
    assert results and {r.status for r in results} == {404}


async def test_a_gateway_that_is_not_there_is_a_clear_error():
    with pytest.raises(Exception):  # noqa: B017 - httpx's ConnectError
        await run("http://127.0.0.1:9", [stream("p", "primary")], 0.2)
    results = await run("http://127.0.0.1:9", [stream("p", "primary", model=MODEL)], 0.3)
    assert results and {(r.status, r.error) for r in results} == {(0, "transport")}


def test_stream_names_must_be_unique():
    with pytest.raises(ValueError, match="unique"):
        asyncio.run(run("http://127.0.0.1:9", [stream("a", "k"), stream("a", "k")], 0.1))
