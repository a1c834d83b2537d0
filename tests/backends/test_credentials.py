"""Fallback credentials: a static key from a secret, and a metadata-server token (workload
identity) fetched over real loopback HTTP from a fake metadata server, on an injected clock."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import orjson
import pytest

from serve_app.backends.credentials import (
    REFRESH_MARGIN_S,
    RETRY_AFTER_S,
    GcpMetadataToken,
    NoCredentials,
    StaticKey,
    credentials_for,
)
from serve_app.config.models import FallbackConfig
from serve_app.errors import ForgeError
from tests.backends.loopback import TOKEN_PATH, FakeMetadataServer, refused_url, serve_on_loopback
from tests.doubles import Clock

KEY_ENV = "FORGE_TEST_CREDENTIALS_KEY"


# --- StaticKey -------------------------------------------------------------------------------


async def test_static_key_is_read_once_at_start(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-secret-1")
    key = StaticKey(KEY_ENV)
    monkeypatch.setenv(KEY_ENV, "sk-rotated")  # a rotated secret takes a restart, by design
    assert await key.headers() == {"authorization": "Bearer sk-secret-1"}


@pytest.mark.parametrize("value", [None, "", "   "])
def test_static_key_missing_secret_is_a_clear_error_at_start(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_ENV, value)
    with pytest.raises(RuntimeError) as info:
        StaticKey(KEY_ENV)
    assert KEY_ENV in str(info.value) and "fallback.api_key_env" in str(info.value)


def test_static_key_repr_names_the_variable_not_the_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-secret-1")
    key = StaticKey(KEY_ENV)
    assert "sk-secret-1" not in repr(key) and KEY_ENV in repr(key)


# --- credentials_for -------------------------------------------------------------------------


async def test_credentials_follow_the_configured_auth_mode(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-secret-1")
    base = {"base_url": "https://upstream.test/v1/", "model": "m"}
    keyed = credentials_for(FallbackConfig(**base, api_key_env=KEY_ENV))
    assert isinstance(keyed, StaticKey)
    keyless = credentials_for(FallbackConfig(**base))
    assert isinstance(keyless, NoCredentials) and await keyless.headers() == {}
    metadata = credentials_for(
        FallbackConfig(**base, auth="gcp_metadata", metadata_url="http://127.0.0.1:9/token")
    )
    assert isinstance(metadata, GcpMetadataToken) and metadata.url == "http://127.0.0.1:9/token"
    await metadata.aclose()


# --- GcpMetadataToken ------------------------------------------------------------------------


@pytest.fixture
async def metadata() -> AsyncIterator[tuple[FakeMetadataServer, Callable[..., GcpMetadataToken]]]:
    """A fake metadata server on loopback, and a factory of token sources pointed at it."""
    server = FakeMetadataServer()
    sources: list[GcpMetadataToken] = []
    async with serve_on_loopback(server.app) as url:

        def make(clock: Clock | None = None, token_url: str = url + TOKEN_PATH):
            source = GcpMetadataToken(token_url, clock=clock or Clock(1000.0))
            sources.append(source)
            return source

        yield server, make
        for source in sources:
            await source.aclose()


async def test_token_is_fetched_with_the_metadata_flavor_header(metadata):
    server, make = metadata
    assert await make().headers() == {"authorization": "Bearer token-1"}
    assert [r.get("metadata-flavor") for r in server.requests] == ["Google"]


async def test_token_is_cached_across_requests(metadata):
    server, make = metadata
    clock = Clock(1000.0)
    source = make(clock)
    for _ in range(5):
        assert await source.headers() == {"authorization": "Bearer token-1"}
        clock.now += 60
    assert len(server.requests) == 1


async def test_token_is_refreshed_five_minutes_before_expiry(metadata):
    server, make = metadata
    clock = Clock(1000.0)
    source = make(clock)
    assert await source.headers() == {"authorization": "Bearer token-1"}
    clock.now += server.expires_in - REFRESH_MARGIN_S - 1
    assert await source.headers() == {"authorization": "Bearer token-1"}
    clock.now += 1
    assert await source.headers() == {"authorization": "Bearer token-2"}
    assert len(server.requests) == 2


async def test_a_short_lived_token_is_refreshed_at_half_life(metadata):
    """A token living less than the margin would otherwise be refetched on every request."""
    server, make = metadata
    server.expires_in = 200
    clock = Clock(1000.0)
    source = make(clock)
    assert await source.headers() == {"authorization": "Bearer token-1"}
    clock.now += 99
    assert await source.headers() == {"authorization": "Bearer token-1"}
    clock.now += 1
    assert await source.headers() == {"authorization": "Bearer token-2"}


async def test_concurrent_callers_share_one_refresh(metadata):
    server, make = metadata
    server.hold = asyncio.Event()
    source = make()
    callers = [asyncio.create_task(source.headers()) for _ in range(20)]
    await server.arrived.wait()  # the first caller's fetch is in; the rest queue behind it
    server.hold.set()
    results = await asyncio.gather(*callers)
    assert results == [{"authorization": "Bearer token-1"}] * 20
    assert len(server.requests) == 1


@pytest.mark.parametrize("status", [403, 404, 500, 503])
async def test_fetch_failure_is_a_502_that_never_quotes_the_answer(metadata, caplog, status):
    server, make = metadata
    server.fail_with = status
    with caplog.at_level(logging.DEBUG), pytest.raises(ForgeError) as info:
        await make().headers()
    assert info.value.status == 502
    assert "credentials unavailable" in info.value.message
    assert "leaked" not in info.value.message and "leaked" not in caplog.text
    assert f"HTTP {status}" in caplog.text


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        orjson.dumps({"expires_in": 3600}),
        orjson.dumps({"access_token": "", "expires_in": 3600}),
        orjson.dumps({"access_token": "t", "expires_in": "soon"}),
        orjson.dumps({"access_token": "t", "expires_in": 0}),
    ],
)
async def test_a_malformed_token_answer_is_a_502(metadata, body):
    server, make = metadata
    server.body = body
    with pytest.raises(ForgeError) as info:
        await make().headers()
    assert info.value.status == 502


async def test_an_unreachable_metadata_server_is_a_502(metadata):
    _, make = metadata
    with pytest.raises(ForgeError) as info:
        await make(token_url=refused_url()).headers()
    assert info.value.status == 502


async def test_concurrent_callers_share_a_failed_refresh_too(metadata):
    """Callers queued behind a failing refresh take its 502 instead of each trying again."""
    server, make = metadata
    server.hold, server.fail_with = asyncio.Event(), 500
    source = make()
    callers = [asyncio.create_task(source.headers()) for _ in range(10)]
    await server.arrived.wait()
    server.hold.set()
    results = await asyncio.gather(*callers, return_exceptions=True)
    assert all(isinstance(r, ForgeError) and r.status == 502 for r in results)
    assert len(server.requests) == 1


async def test_a_failed_refresh_keeps_the_valid_token_and_retries_later(metadata):
    server, make = metadata
    clock = Clock(1000.0)
    source = make(clock)
    assert await source.headers() == {"authorization": "Bearer token-1"}
    server.fail_with = 500
    clock.now += server.expires_in - REFRESH_MARGIN_S  # refresh due, token still valid
    assert await source.headers() == {"authorization": "Bearer token-1"}
    assert len(server.requests) == 2
    clock.now += RETRY_AFTER_S - 1  # no new attempt before the retry delay
    assert await source.headers() == {"authorization": "Bearer token-1"}
    assert len(server.requests) == 2
    server.fail_with = None
    clock.now += 1
    assert await source.headers() == {"authorization": "Bearer token-2"}


async def test_an_expired_token_is_never_sent(metadata):
    server, make = metadata
    clock = Clock(1000.0)
    source = make(clock)
    await source.headers()
    server.fail_with = 503
    clock.now += server.expires_in  # expired, and the metadata server is down
    with pytest.raises(ForgeError) as info:
        await source.headers()
    assert info.value.status == 502


async def test_tokens_never_reach_the_logs(metadata, caplog):
    server, make = metadata
    clock = Clock(1000.0)
    source = make(clock)
    with caplog.at_level(logging.DEBUG):
        await source.headers()
        server.fail_with = 500
        clock.now += server.expires_in - REFRESH_MARGIN_S
        await source.headers()
    assert "token-1" not in caplog.text
    assert "token-1" not in repr(source)
