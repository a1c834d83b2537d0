"""RedisStore when Redis is gone, silent, or cuts its connections, and what the contract can't see.

Every failure must surface as ``StoreError`` within about the configured timeout, so the gateway
fails open without stalling a request; and the store must recover by itself once Redis answers.
No test here pauses or flushes the shared server: failures are simulated with a closed port, a
local socket that never answers, a local proxy we stop and restart, and ``CLIENT KILL`` of the
test's own connections only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from uuid import uuid4

import pytest
from redis.asyncio import Redis

from serve_app.store import Bucket, RedisStore, StoreError
from tests.store.conftest import REDIS_URL

BUCKET = Bucket("quota:t:rpm", 10, 1e-6)

OPERATIONS: dict[str, Callable[[RedisStore], Awaitable[object]]] = {
    "take": lambda s: s.take([BUCKET], [1]),
    "adjust": lambda s: s.adjust(BUCKET, 1),
    "peek": lambda s: s.peek([BUCKET]),
    "acquire_lease": lambda s: s.acquire_lease("streams:t", "a", 1, 10),
    "renew_lease": lambda s: s.renew_lease("streams:t", "a", 10),
    "renew_leases": lambda s: s.renew_leases([("streams:t", "a")], 10),
    "release_lease": lambda s: s.release_lease("streams:t", "a"),
    "ping": lambda s: s.ping(),
}


async def assert_fails_fast(store: RedisStore, operation: str) -> None:
    started = time.monotonic()
    with pytest.raises(StoreError, match=operation):
        await OPERATIONS[operation](store)
    # A sanity bound only: the timeout is 50 ms, the machine is shared.
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize("operation", OPERATIONS)
async def test_closed_port_raises_store_error_quickly(operation: str) -> None:
    store = RedisStore.from_url("redis://127.0.0.1:1/0")
    try:
        await assert_fails_fast(store, operation)
    finally:
        await store.close()


@pytest.fixture
async def silent_server() -> AsyncIterator[int]:
    """A socket that accepts connections and never answers: a hung Redis."""
    writers: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while await reader.read(65536):
            pass

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    for writer in writers:
        writer.close()
    server.close()


@pytest.mark.parametrize("operation", ["take", "acquire_lease", "release_lease"])
async def test_silent_server_times_out_as_store_error(silent_server: int, operation: str) -> None:
    store = RedisStore.from_url(f"redis://127.0.0.1:{silent_server}/0", timeout_s=0.05)
    try:
        await assert_fails_fast(store, operation)
    finally:
        await store.close()


async def own_connection_ids(admin: Redis, client_name: str) -> list[int]:
    clients = await admin.client_list()
    return [int(c["id"]) for c in clients if c.get("name") == client_name]


async def kill_own_connections(admin: Redis, client_name: str) -> set[int]:
    killed = set(await own_connection_ids(admin, client_name))
    assert killed
    for connection_id in killed:  # only this test's own connections, never anyone else's
        await admin.execute_command("CLIENT", "KILL", "ID", connection_id)
    return killed


async def test_reconnects_after_its_connections_are_killed(
    redis_admin: Redis, key_prefix: str
) -> None:
    name = f"forge-test-{uuid4().hex}"
    store = RedisStore.from_url(REDIS_URL, key_prefix=key_prefix, client_name=name)
    try:
        results = await asyncio.gather(*(store.take([BUCKET], [1]) for _ in range(4)))
        assert all(r.granted for r in results)

        # Once the close has reached the client (as after a Redis restart), the pool sees the
        # dead sockets before using them and reconnects; the state lives on in Redis.
        killed = await kill_own_connections(redis_admin, name)
        # Kept, and short: the pool drops a dead socket only once the loop has read its EOF,
        # which nothing outside redis-py's internals shows. Redis closes them before it answers
        # the kill, so the loop's first turn here sees them; 0.1 s covers a lazier close.
        await asyncio.sleep(0.1)
        result = await store.take([BUCKET], [1])
        assert result.granted
        assert result.remaining[0] == pytest.approx(5, abs=1e-3)
        assert not set(await own_connection_ids(redis_admin, name)) & killed

        # A connection killed while in use fails that one call (no retries: a take is not
        # idempotent) and the next call reconnects.
        await kill_own_connections(redis_admin, name)
        with contextlib.suppress(StoreError):
            await store.take([BUCKET], [1])
        assert (await store.take([BUCKET], [1])).granted
    finally:
        await store.close()


class Proxy:
    """A TCP proxy to the real Redis that can be stopped and restarted on the same port."""

    def __init__(self) -> None:
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and close every connection; returns once their sockets are closed."""
        assert self._server is not None
        self._server.close()
        writers = list(self._writers)
        for writer in writers:
            writer.close()
        for writer in writers:
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", 6379)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_fails_while_redis_is_down_and_recovers_when_it_returns(
    redis_admin: Redis, key_prefix: str
) -> None:
    proxy = Proxy()
    await proxy.start()
    store = RedisStore.from_url(f"redis://127.0.0.1:{proxy.port}/0", key_prefix=key_prefix)
    try:
        assert (await store.take([BUCKET], [3])).granted
        await proxy.stop()  # returns with the client's sockets closed by "Redis"
        for operation in ("take", "acquire_lease", "release_lease"):
            await assert_fails_fast(store, operation)
        await proxy.start()
        result = await store.take([BUCKET], [3])
        assert result.granted
        assert result.remaining[0] == pytest.approx(4, abs=1e-3)
    finally:
        await store.close()
        await proxy.stop()


async def test_every_key_is_prefixed_and_expires(redis_admin: Redis, key_prefix: str) -> None:
    store = RedisStore.from_url(REDIS_URL, key_prefix=key_prefix, timeout_s=2.0)
    tokens = Bucket("quota:t:tpm", 1000, 10)  # empty → full takes 100 s
    try:
        await store.take([BUCKET, tokens], [1, 1000])
        await store.adjust(Bucket("quota:t:small", 10, 10), -1)
        await store.acquire_lease("streams:t", "a", 1, 30)
        keys = [k.decode() async for k in redis_admin.scan_iter(match=f"{key_prefix}*")]
        ttls = {k.removeprefix(key_prefix): await redis_admin.pttl(k) / 1000 for k in keys}
    finally:
        await store.close()
    assert set(ttls) == {
        "quota:t:rpm",
        "quota:t:tpm",
        "quota:t:small",
        "streams:t",
    }
    assert 86_000 < ttls["quota:t:rpm"] <= 86_400  # no real refill: capped at a day
    assert 199 < ttls["quota:t:tpm"] <= 200  # twice the 100 s it takes to refill from empty
    assert 4 < ttls["quota:t:small"] <= 5  # a tiny deficit still gets the minimum
    assert 29 < ttls["streams:t"] <= 30


async def test_our_own_busy_pool_is_load_not_an_outage(silent_server: int) -> None:
    """A call that waited in vain for a pooled connection says nothing about Redis (the other
    call holds it): a plain StoreError, which GuardedStore does not count towards skipping the
    store. The call that timed out on the wire is StoreUnavailable."""
    store = RedisStore.from_url(
        f"redis://127.0.0.1:{silent_server}/0", timeout_s=0.1, max_connections=1
    )
    try:
        results = await asyncio.gather(
            store.take([BUCKET], [1]), store.take([BUCKET], [1]), return_exceptions=True
        )
    finally:
        await store.close()
    kinds = sorted(type(r).__name__ for r in results)
    assert kinds == ["StoreError", "StoreUnavailable"], results
