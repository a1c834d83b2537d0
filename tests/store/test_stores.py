"""``build_stores``: the budgets on ``store``, the response cache on ``cache.store`` when it names
a Redis of its own, each behind its own breaker.

The two stores are two logical databases of the local Redis; each test writes under a prefix of
its own and deletes only that (nothing here flushes a database someone else may use).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from redis.asyncio import Redis

from serve_app.auth.keys import hash_key
from serve_app.config.models import ConfigError, load_config
from serve_app.local import build_local_gateway
from serve_app.resilience.breaker import State
from serve_app.stages.cache import CacheStage
from serve_app.stages.quota import QuotaStage
from serve_app.store import GuardedStore, MemoryStore, build_stores
from tests.doubles import RecordingMetrics
from tests.polling import eventually_async
from tests.store.conftest import connect_admin, delete_prefix

BUDGETS_URL = "redis://127.0.0.1:6379/13"
CACHE_URL = "redis://127.0.0.1:6379/14"
CLOSED_PORT = "redis://127.0.0.1:1/0"  # nothing listens: a Redis that is gone
KEY = "sk-test-stores"
MODEL = "forge-sim"
FAST = {"prefill_base_s": 0.0, "decode_base_s": 0.0, "output_tokens_min": 4, "output_tokens_max": 8}
DETERMINISTIC = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "where do cached answers live?"}],
    "temperature": 0,
    "max_tokens": 8,
}


def forge_args(key_prefix: str, cache_url: str | None) -> dict:
    # Generous reply timeouts: the point is where keys land, on a busy shared machine.
    args: dict = {
        "tenants": [
            {
                "name": "alpha",
                "key_hashes": [hash_key(KEY)],
                "limits": {"rpm": 600, "tpm": 100_000, "max_concurrent_streams": 4},
            }
        ],
        "pools": [{"name": "primary", "model": MODEL, "engine": FAST}],
        "store": {"redis_url": BUDGETS_URL, "key_prefix": key_prefix, "timeout_s": 2.0},
    }
    if cache_url is not None:
        args["cache"] = {
            "store": {"redis_url": cache_url, "key_prefix": key_prefix, "timeout_s": 2.0}
        }
    return args


async def keys(admin: Redis, prefix: str) -> set[str]:
    return {key.decode() async for key in admin.scan_iter(match=f"{prefix}*", count=500)}


@pytest.fixture
async def databases(key_prefix: str) -> AsyncIterator[tuple[Redis, Redis]]:
    """Admin clients of the budgets' and the cache's databases; the test's keys go after it."""
    await (await connect_admin()).aclose()  # skips the test where no Redis answers
    budgets, cache = Redis.from_url(BUDGETS_URL), Redis.from_url(CACHE_URL)
    yield budgets, cache
    for admin in (budgets, cache):
        await delete_prefix(admin, key_prefix)
        await admin.aclose()


async def chat(client: httpx.AsyncClient) -> httpx.Response:
    response = await client.post(
        "/v1/chat/completions", json=DETERMINISTIC, headers={"authorization": f"Bearer {KEY}"}
    )
    assert response.status_code == 200, response.text
    return response


async def test_cached_answers_land_on_the_cache_store_and_budgets_on_the_main_one(
    databases: tuple[Redis, Redis], key_prefix: str
) -> None:
    budgets, cache = databases
    metrics = RecordingMetrics()
    gateway = build_local_gateway(load_config(forge_args(key_prefix, CACHE_URL)), metrics=metrics)
    cache_stage = gateway.pipeline.stage(CacheStage)
    assert cache_stage.store is not gateway.pipeline.stage(QuotaStage).store
    transport = httpx.ASGITransport(gateway.asgi_app())
    async with (
        gateway.lifespan(),
        httpx.AsyncClient(transport=transport, base_url="http://forge.test") as client,
    ):
        assert (await chat(client)).headers["x-forge-cache"] == "miss"
        await eventually_async(
            lambda: {"result": "stored"} in metrics.cache_stores.calls,
            timeout_s=10,
            what="the miss's answer stored",
            explain=lambda: metrics.cache_stores.calls,
        )
        assert (await chat(client)).headers["x-forge-cache"] == "hit"

    on_budgets, on_cache = await keys(budgets, key_prefix), await keys(cache, key_prefix)
    cache_entries = {k for k in on_cache if k.startswith(f"{key_prefix}cache:")}
    assert len(cache_entries) == 1 and on_cache == cache_entries, on_cache
    assert any(k.startswith(f"{key_prefix}quota:") for k in on_budgets), on_budgets
    assert not any(k.startswith(f"{key_prefix}cache:") for k in on_budgets), on_budgets


async def test_without_a_cache_store_the_cache_shares_the_main_one(
    databases: tuple[Redis, Redis], key_prefix: str
) -> None:
    budgets, cache = databases
    metrics = RecordingMetrics()
    gateway = build_local_gateway(load_config(forge_args(key_prefix, None)), metrics=metrics)
    assert gateway.pipeline.stage(CacheStage).store is gateway.pipeline.stage(QuotaStage).store
    transport = httpx.ASGITransport(gateway.asgi_app())
    async with (
        gateway.lifespan(),
        httpx.AsyncClient(transport=transport, base_url="http://forge.test") as client,
    ):
        await chat(client)
        await eventually_async(
            lambda: {"result": "stored"} in metrics.cache_stores.calls,
            timeout_s=10,
            what="the miss's answer stored",
        )
    on_budgets = await keys(budgets, key_prefix)
    assert any(k.startswith(f"{key_prefix}cache:") for k in on_budgets), on_budgets
    assert await keys(cache, key_prefix) == set()


async def test_a_lost_cache_redis_trips_its_own_breaker_and_budgets_carry_on(
    databases: tuple[Redis, Redis], key_prefix: str
) -> None:
    budgets, _ = databases
    metrics = RecordingMetrics()
    config = load_config(forge_args(key_prefix, CLOSED_PORT))
    gateway = build_local_gateway(config, metrics=metrics)
    transport = httpx.ASGITransport(gateway.asgi_app())
    async with (
        gateway.lifespan(),
        httpx.AsyncClient(transport=transport, base_url="http://forge.test") as client,
    ):
        for _ in range(config.cache.store.breaker.failure_threshold + 1):
            response = await chat(client)  # served, uncached: the cache fails open
            assert response.headers["x-forge-cache"] == "bypass"
        assert gateway.pipeline.stage(CacheStage).store.state is State.OPEN
        assert gateway.store.state is State.CLOSED  # the budgets' breaker heard nothing of it
        assert {"store": "cache"} in metrics.store_state.calls
        assert {"store": "main"} not in metrics.store_state.calls

        # With no traffic, the states are set again (Ray's export drops a gauge left unset).
        metrics.store_state.calls.clear()
        metrics.store_state.values.clear()
        gateway.publish_states()
        published = dict(
            zip(
                (c["store"] for c in metrics.store_state.calls),
                metrics.store_state.values,
                strict=True,
            )
        )
        assert published == {"main": int(State.CLOSED), "cache": int(State.OPEN)}
        # and the retry budget's remainder: no retry spent, all of it
        assert metrics.retry_budget.values[-1] >= config.resilience.retry_budget.min_retries
    assert metrics.unmetered.calls == []  # every request was held to the Redis budget
    assert any(k.startswith(f"{key_prefix}quota:") for k in await keys(budgets, key_prefix))


def test_an_unset_cache_store_variable_stops_start_up(monkeypatch) -> None:
    """As the main store's does (``StoreConfig.resolved_url``): the cache is never quietly moved
    onto the budgets' Redis, whose noeviction it would fill."""
    monkeypatch.delenv("FORGE_TEST_CACHE_REDIS", raising=False)
    args = forge_args("forge:", None)
    args["cache"] = {"store": {"redis_url_env": "FORGE_TEST_CACHE_REDIS"}}
    config = load_config(args)
    with pytest.raises(ConfigError, match=r"cache\.store\.redis_url_env names FORGE_TEST_CACHE"):
        build_stores(config)
    monkeypatch.setenv("FORGE_TEST_CACHE_REDIS", CACHE_URL)
    stores = build_stores(config)
    assert isinstance(stores.cache, GuardedStore) and stores.cache is not stores.main


def test_the_stores_without_redis_are_one_embedded_store() -> None:
    args = forge_args("forge:", None)
    del args["store"]
    stores = build_stores(load_config(args))
    assert isinstance(stores.main, MemoryStore)
    assert stores.cache is stores.main and stores.usage is None


def test_a_disabled_cache_builds_no_store_of_its_own(monkeypatch) -> None:
    monkeypatch.delenv("FORGE_TEST_CACHE_REDIS", raising=False)
    args = forge_args("forge:", None)
    args["cache"] = {"enabled": False, "store": {"redis_url_env": "FORGE_TEST_CACHE_REDIS"}}
    stores = build_stores(load_config(args))  # the unset variable is never read
    assert stores.cache is stores.main
    assert isinstance(stores.usage, GuardedStore)  # main's Redis, with a patient timeout
