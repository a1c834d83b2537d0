"""The gateway's HTTP surface without Ray: the official ``openai`` client through httpx's
``ASGITransport``, into a ``Gateway`` wired in process (``serve_app/local.py``): real replicas and
engines, a real fair scheduler, a real breaker board, the embedded store, and the mock fallback
(also an ASGI app) behind the real ``FallbackBackend``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from serve_app.auth.keys import hash_key
from serve_app.config.models import load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.mock_openai import create_mock_app
from serve_app.resilience.board import BreakerBoard
from serve_app.stages.admission import AdmissionStage
from serve_app.stages.authenticate import AuthStage
from serve_app.stages.cache import CacheStage
from serve_app.stages.metering import MeterStage
from serve_app.stages.parse import ParseStage
from serve_app.stages.quota import QuotaStage
from serve_app.stages.request_id import RequestIdStage
from serve_app.stages.telemetry import TelemetryStage
from serve_app.store import GuardedStore
from tests.doubles import Clock, DownStore, RecordingMetrics
from tests.polling import eventually_async

KEY = "sk-test-gateway"
CAPPED_KEY = "sk-test-capped"
UPSTREAM_KEY = "sk-test-upstream"
KEY_ENV = "FORGE_TEST_GATEWAY_UPSTREAM_KEY"
MODEL = "forge-sim"
FAST = {"prefill_base_s": 0.0, "decode_base_s": 0.0, "output_tokens_min": 4, "output_tokens_max": 8}


def forge_args() -> dict:
    return {
        "gateway": {"max_body_bytes": 4096},
        "tenants": [
            {"name": "alpha", "key_hashes": [hash_key(KEY)]},
            {
                "name": "capped",
                "key_hashes": [hash_key(CAPPED_KEY)],
                "limits": {"rpm": 1, "burst_requests": 2},
            },
        ],
        "pools": [
            {
                "name": "primary",
                "model": MODEL,
                "engine": FAST,
                "admission": {"max_inflight": 4},
                "deployment": {"num_replicas": 2},
            }
        ],
        "fallback": {
            "base_url": "http://upstream.test/v1",
            "model": "mock-gemini",
            "api_key_env": KEY_ENV,
            "first_token_timeout_s": 5,
        },
        "resilience": {"fallback_probe_interval_s": 0.05},
    }


def upstream(api_key: str = UPSTREAM_KEY) -> httpx.ASGITransport:
    return httpx.ASGITransport(create_mock_app("mock-gemini", FAST, api_key=api_key))


@pytest.fixture
async def gateway(monkeypatch) -> AsyncIterator[Gateway]:
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    gateway = build_local_gateway(load_config(forge_args()), fallback_transport=upstream())
    async with gateway.lifespan():
        yield gateway


def http(gateway: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(gateway.asgi_app()), base_url="http://forge.test"
    )


@pytest.fixture
async def client(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url="http://forge.test/v1", api_key=KEY, http_client=http(gateway), max_retries=0
    ) as client:
        yield client


def ask(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello, Forge"}], **extra}


def test_one_function_lists_the_stages_in_the_designs_order(gateway: Gateway):
    assert [type(s) for s in gateway.pipeline.stages] == [
        RequestIdStage,
        TelemetryStage,
        AuthStage,
        MeterStage,
        ParseStage,
        QuotaStage,
        CacheStage,
        AdmissionStage,
    ]


async def test_chat_completion_through_the_openai_client(client: openai.AsyncOpenAI):
    raw = await client.chat.completions.with_raw_response.create(**ask(max_tokens=4))
    completion = raw.parse()
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens <= 4
    assert raw.headers["x-forge-backend"] == "primary"
    assert raw.headers["x-forge-replica"] in {"primary-0", "primary-1"}
    assert raw.headers["x-request-id"]


async def test_streaming_chat_through_the_openai_client(client: openai.AsyncOpenAI):
    stream = await client.chat.completions.create(
        **ask(max_tokens=5), stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens <= 5


async def test_null_for_a_default_is_the_default_as_openai_takes_it(client: openai.AsyncOpenAI):
    """OpenAI's API takes null for stream and n (its SDKs send it when told None)."""
    completion = await client.chat.completions.create(**ask(max_tokens=2), stream=None, n=None)
    assert completion.choices[0].message.content
    legacy = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=None)
    assert legacy.choices[0].text


async def test_an_empty_prompt_is_refused_as_vllm_refuses_it(client: openai.AsyncOpenAI):
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model=MODEL, prompt="", max_tokens=2)
    assert refused.value.body["param"] == "prompt"
    assert refused.value.body["code"] != "context_length_exceeded"  # no window was exceeded


async def test_models_lists_the_pool_and_the_fallback(client: openai.AsyncOpenAI):
    models = [m.id async for m in client.models.list()]
    assert models == [MODEL, "mock-gemini"]


@pytest.mark.parametrize("authorization", [None, "Bearer sk-wrong", "Basic abc"])
async def test_no_or_wrong_key_is_an_openai_shaped_401(gateway: Gateway, authorization):
    headers = {"authorization": authorization} if authorization else {}
    async with http(gateway) as h:
        response = await h.post("/v1/chat/completions", json=ask(), headers=headers)
        models = await h.get("/v1/models", headers=headers)
    assert response.status_code == models.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] and error["message"]


async def test_the_clients_request_id_is_echoed(gateway: Gateway):
    async with http(gateway) as h:
        response = await h.post(
            "/v1/chat/completions",
            json=ask(max_tokens=2),
            headers={"authorization": f"Bearer {KEY}", "x-request-id": "trace-abc.123"},
        )
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-abc.123"


async def test_an_oversized_body_is_a_413(gateway: Gateway):
    async with http(gateway) as h:
        response = await h.post(
            "/v1/chat/completions",
            json=ask(messages=[{"role": "user", "content": "x" * 10_000}]),
            headers={"authorization": f"Bearer {KEY}"},
        )
    assert response.status_code == 413
    assert response.json()["error"]["message"]


async def test_a_tenant_over_budget_gets_429_with_retry_after(gateway: Gateway):
    async with http(gateway) as h:
        statuses = []
        for _ in range(3):
            response = await h.post(
                "/v1/chat/completions",
                json=ask(max_tokens=2),
                headers={"authorization": f"Bearer {CAPPED_KEY}"},
            )
            statuses.append(response.status_code)
    assert statuses == [200, 200, 429]
    assert int(response.headers["retry-after"]) >= 1


async def test_failing_replicas_are_served_by_the_fallback(gateway: Gateway, client):
    for replica in gateway.backends["primary"].replicas.values():
        replica.set_fault({"mode": "error"})
    raw = await client.chat.completions.with_raw_response.create(**ask(max_tokens=3))
    assert raw.headers["x-forge-backend"] == "fallback"
    assert raw.parse().choices[0].message.content


async def test_the_fallback_is_probed_from_start_up_even_if_nobody_asks(monkeypatch):
    """Bug: the fallback's health timer started on the first /readyz, so an idle dead
    fallback went unnoticed. Here nothing calls /readyz, and its breaker still hears of it."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    args = forge_args()
    board = BreakerBoard()

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    gateway = build_local_gateway(
        load_config(args), fallback_transport=httpx.MockTransport(unreachable), board=board
    )
    async with gateway.lifespan():
        await eventually_async(
            lambda: gateway.fallback_health.healthy is False, timeout_s=5, what="a failed probe"
        )
        await gateway.breakers.flush()
        failures = (await board.describe())["fallback"]["consecutive_failures"]
        assert failures >= 1


@pytest.mark.parametrize("on_store_failure", ["local", "open"])
async def test_with_the_store_down_budgets_hold_locally_or_open_and_the_store_is_skipped(
    monkeypatch, on_store_failure
):
    """Redis gone (the review's case: a tenant with ``rpm: 10`` sent 30 and all were served):
    by default each gateway replica holds the tenant to its share of the limits (one replica
    here: the whole burst of 2), and only a tenant that chose ``open`` is served unmetered."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    down, metrics = DownStore(), RecordingMetrics()
    args = forge_args()
    args["tenants"][1]["on_store_failure"] = on_store_failure
    gateway = build_local_gateway(
        load_config(args),
        # On a clock that moves only when told: the guard's 1 s cooldown cannot end mid-test
        # (a probe would reach the store) however slowly the ten requests run.
        store=GuardedStore(down, clock=Clock()),
        metrics=metrics,
        fallback_transport=upstream(),
    )
    async with gateway.lifespan(), http(gateway) as h:
        statuses = [
            (
                await h.post(
                    "/v1/chat/completions",
                    json=ask(max_tokens=2),
                    headers={"authorization": f"Bearer {CAPPED_KEY}"},
                )
            ).status_code
            for _ in range(10)
        ]
        assert down.calls == 3, "after three failures the store was not asked again"
    if on_store_failure == "open":
        assert statuses == [200] * 10  # over its 2-request burst: nothing enforces it
        assert metrics.unmetered.calls == [{"tenant": "capped"}] * 10
    else:
        assert statuses == [200] * 2 + [429] * 8  # its burst of 2, from this replica's memory
        assert metrics.unmetered.calls == []
        assert metrics.locally_metered.calls == [{"tenant": "capped"}] * 10
