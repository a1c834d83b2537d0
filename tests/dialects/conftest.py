"""A gateway wired in process (``serve_app/local.py``: real replicas and engines, the embedded
store, the mock fallback), reached by the official clients through ASGI transports: the
dialects' behaviour as an SDK sees it, without Ray."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anthropic
import httpx2
import openai
import pytest

from serve_app.gateway.server import Gateway
from tests.gateway import test_server
from tests.gateway.test_server import CAPPED_KEY, KEY, http

# The gateway test's own in-process gateway, served to these tests as the same fixture.
gateway = test_server.gateway
OTHER_KEY = CAPPED_KEY  # the capped tenant of test_server's forge_args: another tenant's view
STATUS_SCHEMA = {
    "type": "object",
    "properties": {"service": {"type": "string"}},
    "required": ["service"],
}
ASK = "What is the service status of checkout?"


def openai_client(gateway: Gateway, key: str = KEY, *, strict: bool = False) -> openai.AsyncOpenAI:
    """``strict``: the SDK holds every answer to its own types (``_strict_response_validation``)."""
    return openai.AsyncOpenAI(
        base_url="http://forge.test/v1",
        api_key=key,
        http_client=http(gateway),
        max_retries=0,
        _strict_response_validation=strict,
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
