"""The ``store`` fixture: every contract test runs against the embedded store and real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from uuid import uuid4

import pytest
from redis.asyncio import Redis

from serve_app.store import MemoryStore, RedisStore, Store

REDIS_URL = "redis://127.0.0.1:6379/0"


async def delete_prefix(admin: Redis, prefix: str) -> None:
    keys = [key async for key in admin.scan_iter(match=f"{prefix}*", count=500)]
    if keys:
        await admin.delete(*keys)


async def connect_admin() -> Redis:
    """A plain client for setup and inspection; skips the test when no Redis answers."""
    admin = Redis.from_url(REDIS_URL, socket_connect_timeout=1, socket_timeout=2)
    try:
        await admin.ping()
    except Exception as exc:
        await admin.aclose()
        pytest.skip(f"no Redis answers on {REDIS_URL} ({exc!r}); .ci/run starts one")
    return admin


@pytest.fixture
def key_prefix() -> str:
    """A prefix no other test (or engineer) shares on the shared Redis."""
    return f"forge-test:{uuid4().hex}:"


@pytest.fixture
async def redis_admin(key_prefix: str) -> AsyncIterator[Redis]:
    """The admin client; on teardown it deletes every key under the test's prefix."""
    admin = await connect_admin()
    yield admin
    await delete_prefix(admin, key_prefix)
    await admin.aclose()


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, key_prefix: str) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    admin = await connect_admin()
    # The contract is about semantics, so give a busy shared machine a generous reply timeout;
    # the fail-fast default (50 ms) is exercised in test_redis_failures.py.
    redis_store = RedisStore.from_url(REDIS_URL, key_prefix=key_prefix, timeout_s=2.0)
    yield redis_store
    await redis_store.close()
    await delete_prefix(admin, key_prefix)
    await admin.aclose()
