"""A gateway wired in process (``serve_app/local.py``: real replicas and engines, the embedded
store, the mock fallback), reached by the official clients through ASGI transports: the
dialects' behaviour as an SDK sees it, without Ray."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import httpx
import httpx2
import openai
import pytest

from serve_app.config.models import load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from tests.gateway.test_server import KEY, KEY_ENV, UPSTREAM_KEY, forge_args, upstream

OTHER_KEY = "sk-test-capped"  # the capped tenant of forge_args: another tenant's view
STATUS_SCHEMA = {
    "type": "object",
    "properties": {"service": {"type": "string"}},
    "required": ["service"],
}
ASK = "What is the service status of checkout?"


@pytest.fixture
async def gateway(monkeypatch) -> AsyncIterator[Gateway]:
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    gateway = build_local_gateway(load_config(forge_args()), fallback_transport=upstream())
    async with gateway.lifespan():
        yield gateway


def asgi(gateway: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(gateway.asgi_app()), base_url="http://forge.test"
    )


def openai_client(gateway: Gateway, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://forge.test/v1", api_key=key, http_client=asgi(gateway), max_retries=0
    )


def anthropic_client(gateway: Gateway, key: str = KEY) -> anthropic.AsyncAnthropic:
    # The anthropic SDK runs on httpx2, httpx's successor, which has its own ASGI transport.
    transport = httpx2.ASGITransport(gateway.asgi_app())
    return anthropic.AsyncAnthropic(
        base_url="http://forge.test",
        api_key=key,
        http_client=httpx2.AsyncClient(transport=transport, base_url="http://forge.test"),
        max_retries=0,
    )


@pytest.fixture
async def oai(gateway: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(gateway) as client:
        yield client


@pytest.fixture
async def claude(gateway: Gateway) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic_client(gateway) as client:
        yield client
