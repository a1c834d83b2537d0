"""The failed-auth throttle and the request limits, as a client sees them.

The throttle's rule (``serve_app/auth/throttle.py``) with a clock of its own, then the whole
gateway in process (official client and raw httpx over ``ASGITransport``) on the real Redis:
a flood of wrong keys turns from 401s into 429s with ``Retry-After`` while a valid key from the
same address is served, a missing key stays a 401, the admin API counts the same failures, and
the flood sends Redis no command at all.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from serve_app.auth.keys import hash_key
from serve_app.auth.throttle import PREFIX_CHARS, FailedAuthThrottle
from serve_app.config.models import AuthThrottleConfig, load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.store.redis import RedisStore
from tests.doubles import RecordingMetrics

KEY = "sk-test-throttle"
ADMIN_KEY = "sk-test-throttle-admin"
MODEL = "forge-sim"
FAST = {"prefill_base_s": 0.0, "decode_base_s": 0.0, "output_tokens_min": 2, "output_tokens_max": 4}
PER_PREFIX, PER_ADDRESS = 5, 8


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def throttle(clock: Clock, **config) -> FailedAuthThrottle:
    defaults = {"max_failures_per_address": 100, "max_failures_per_prefix": 3, "window_s": 60}
    return FailedAuthThrottle(AuthThrottleConfig(**defaults | config), clock=clock)


def test_wrong_keys_turn_into_429s_past_the_limit_and_back_after_the_window():
    clock = Clock()
    gate = throttle(clock)
    statuses = []
    for _ in range(5):
        statuses.append(gate.refusal("10.0.0.1", "sk-wrong-aaaaaaaa").status)
        clock.now += 1
    assert statuses == [401, 401, 401, 429, 429]
    refused = gate.refusal("10.0.0.1", "sk-wrong-aaaaaaaa")
    # The oldest of the last four failures (at 1002) leaves the window at 1062; it is 1005.
    assert refused.headers["retry-after"] == "57"
    assert refused.body()["error"]["type"] == "rate_limit_error"
    clock.now += 61
    assert gate.refusal("10.0.0.1", "sk-wrong-aaaaaaaa").status == 401


def test_the_address_and_the_key_prefix_are_counted_apart():
    clock = Clock()
    gate = throttle(clock, max_failures_per_address=4, max_failures_per_prefix=100)
    # Many prefixes from one address: the address trips.
    assert [gate.refusal("10.0.0.1", f"sk-{i:08d}").status for i in range(6)] == [401] * 4 + [
        429
    ] * 2
    assert gate.refusal("10.0.0.2", "sk-00000000").status == 401  # another address is fine
    clock.now += 120
    gate = throttle(clock, max_failures_per_address=100, max_failures_per_prefix=2)
    # One prefix from many addresses: the prefix trips (only its first characters count).
    same_prefix = [f"sk-guessing-{i}" for i in range(4)]
    assert len({k[:PREFIX_CHARS] for k in same_prefix}) == 1
    assert [gate.refusal(f"10.1.0.{i}", k).status for i, k in enumerate(same_prefix)] == [
        401,
        401,
        429,
        429,
    ]


def test_memory_is_bounded_by_max_tracked():
    gate = throttle(Clock(), max_tracked=50)
    for i in range(1000):
        gate.refusal(f"10.0.{i // 256}.{i % 256}", f"sk-{i:08d}")
    assert gate.tracked() == 50


# -- the gateway ------------------------------------------------------------------------------


def forge_args(**gateway) -> dict:
    return {
        "gateway": {
            "auth_throttle": {
                "max_failures_per_prefix": PER_PREFIX,
                "max_failures_per_address": PER_ADDRESS,
            },
            **gateway,
        },
        "store": {"redis_url": "redis://127.0.0.1:6379/0", "key_prefix": f"t-{uuid.uuid4()}:"},
        "tenants": [
            {"name": "alpha", "key_hashes": [hash_key(KEY)], "limits": {"rpm": 1000}},
        ],
        "admin": {"key_hashes": [hash_key(ADMIN_KEY)]},
        "pools": [{"model": MODEL, "engine": FAST}],
    }


class CountingRedis:
    """Every command the store's Redis client sends (scripts included: EVALSHA goes through
    ``execute_command`` too)."""

    def __init__(self, store: RedisStore) -> None:
        self.commands: list[str] = []
        client = store._client
        send = client.execute_command

        async def counted(*args, **options):
            self.commands.append(str(args[0]))
            return await send(*args, **options)

        client.execute_command = counted


@pytest.fixture
async def gateway(redis_available) -> AsyncIterator[tuple[Gateway, CountingRedis]]:
    config = load_config(forge_args())
    store = RedisStore.from_url(config.store.redis_url, key_prefix=config.store.key_prefix)
    redis = CountingRedis(store)
    gateway = build_local_gateway(config, store=store, metrics=RecordingMetrics())
    async with gateway.lifespan():
        yield gateway, redis


@pytest.fixture
def redis_available() -> None:
    try:
        socket.create_connection(("127.0.0.1", 6379), timeout=0.5).close()
    except OSError:
        pytest.skip("no Redis on 127.0.0.1:6379 (.ci/run starts one)")


def http(gateway: Gateway) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(gateway.asgi_app()), base_url="http://forge.test"
    )


ASK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_a_flood_of_wrong_keys_is_throttled_without_a_store_command(gateway):
    gateway, redis = gateway
    async with http(gateway) as h:
        served = await h.post("/v1/chat/completions", json=ASK, headers=bearer(KEY))
        assert served.status_code == 200
        redis.commands.clear()
        flood = [
            await h.post("/v1/chat/completions", json=ASK, headers=bearer("sk-wrong-" + "x" * 20))
            for _ in range(PER_PREFIX + 3)
        ]
        assert redis.commands == []  # anonymous traffic never reaches the store
        assert [r.status_code for r in flood] == [401] * PER_PREFIX + [429] * 3
        error = flood[-1].json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "too_many_failed_auth"
        assert int(flood[-1].headers["retry-after"]) >= 1
        # A valid key from the same address is never throttled.
        again = await h.post("/v1/chat/completions", json=ASK, headers=bearer(KEY))
        assert again.status_code == 200
        # No key at all stays a 401, always: it costs no hash to refuse.
        for _ in range(PER_ADDRESS + 2):
            missing = await h.post("/v1/chat/completions", json=ASK)
            assert missing.status_code == 401


async def test_the_admin_api_counts_wrong_keys_with_the_inference_routes(gateway):
    gateway, _ = gateway
    async with http(gateway) as h:
        # Different prefixes: the address is what trips, across both APIs.
        statuses = []
        for i in range(PER_ADDRESS + 2):
            path = "/admin/usage" if i % 2 else "/v1/models"
            response = await h.get(path, headers=bearer(f"sk-{i:04d}-guess-zzzz"))
            statuses.append(response.status_code)
        assert statuses == [401] * PER_ADDRESS + [429] * 2
        admin = await h.get("/admin/status", headers=bearer(ADMIN_KEY))
        assert admin.status_code == 200
    throttled = {"tenant": "anonymous", "reason": "auth_throttle"}
    assert gateway.metrics.shed.calls.count(throttled) == 2


# -- request limits -----------------------------------------------------------------------------


@pytest.fixture
async def limited() -> AsyncIterator[Gateway]:
    args = forge_args(max_messages=10, max_header_bytes=2048, body_timeout_s=0.5)
    args.pop("store")
    gateway = build_local_gateway(load_config(args))
    async with gateway.lifespan():
        yield gateway


async def test_too_many_messages_is_a_400_naming_messages(limited):
    body = {**ASK, "messages": [{"role": "user", "content": "hi"}] * 11}
    async with http(limited) as h:
        response = await h.post("/v1/chat/completions", json=body, headers=bearer(KEY))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("too_many_messages", "messages")


@pytest.mark.parametrize("stray", [1, True, 1.5, 10**30])
async def test_a_stray_messages_field_on_completions_is_no_500(limited, stray):
    """``len(messages)`` of a completion's stray field was the gateway's own 500."""
    body = {"model": ASK["model"], "prompt": "hi", "max_tokens": 2, "messages": stray}
    async with http(limited) as h:
        response = await h.post("/v1/completions", json=body, headers=bearer(KEY))
    assert response.status_code < 500, response.text


async def test_oversized_headers_are_a_431_on_every_route(limited):
    flood = {f"x-junk-{i}": "y" * 40 for i in range(60)}  # ~3 KiB of small headers
    async with http(limited) as h:
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/admin/status")):
            response = await h.request(method, path, json=ASK, headers={**bearer(KEY), **flood})
            assert response.status_code == 431
            assert response.json()["error"]["code"] == "request_headers_too_large"
        assert (await h.post("/v1/chat/completions", json=ASK, headers=bearer(KEY))).is_success


async def test_a_body_that_trickles_in_is_a_408(limited):
    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"model": "forge-sim", '
        await asyncio.sleep(2)
        yield b'"messages": []}'

    async with http(limited) as h:
        response = await h.post("/v1/chat/completions", content=trickle(), headers=bearer(KEY))
    assert response.status_code == 408
    assert response.json()["error"]["code"] == "request_timeout"
