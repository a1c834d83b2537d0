"""MemoryStore with a hand-driven clock: exact bucket arithmetic, and keys that really go away."""

from __future__ import annotations

import math

import pytest

from serve_app.config import StoreConfig
from serve_app.store import Bucket, MemoryStore, build_store
from serve_app.store.base import MIN_BUCKET_TTL_S
from serve_app.store.memory import SWEEP_BATCH, SWEEP_INTERVAL_S
from tests.doubles import Clock


@pytest.fixture
def clock() -> Clock:
    return Clock(1000.0)


@pytest.fixture
def store(clock: Clock) -> MemoryStore:
    return MemoryStore(clock=clock)


async def test_refill_retry_after_and_cap_are_exact(store: MemoryStore, clock: Clock) -> None:
    b = Bucket("b", capacity=10, refill_per_s=2)
    assert (await store.take([b], [10])).granted
    clock.advance(1.5)
    refused = await store.take([b], [5])
    assert not refused.granted
    assert refused.remaining == pytest.approx((3.0,))
    assert refused.retry_after_s == pytest.approx(1.0)
    clock.advance(1.0)
    assert (await store.take([b], [5])).remaining == pytest.approx((0.0,))
    clock.advance(100)
    assert await store.peek([b]) == (10.0,)


async def test_debt_is_repaid_by_refill_before_anything_is_granted(
    store: MemoryStore, clock: Clock
) -> None:
    b = Bucket("b", capacity=10, refill_per_s=2)
    assert await store.adjust(b, -15) == -5
    refused = await store.take([b], [1])
    assert not refused.granted
    assert refused.retry_after_s == pytest.approx(3.0)  # 6 short at 2/s
    clock.advance(2.9)
    assert not (await store.take([b], [1])).granted
    clock.advance(0.1)
    assert (await store.take([b], [1])).granted


async def test_no_refill_means_never(store: MemoryStore) -> None:
    b = Bucket("b", capacity=5, refill_per_s=0)
    assert (await store.take([b], [5])).granted
    assert math.isinf((await store.take([b], [1])).retry_after_s)


async def test_lease_expires_exactly_at_its_ttl(store: MemoryStore, clock: Clock) -> None:
    assert await store.acquire_lease("s", "a", 1, 10) == (True, 1)
    clock.advance(9.999)
    assert await store.acquire_lease("s", "b", 1, 10) == (False, 1)
    clock.advance(0.001)
    assert await store.acquire_lease("s", "b", 1, 10) == (True, 1)


async def test_expired_keys_are_swept_without_being_read(store: MemoryStore, clock: Clock) -> None:
    for i in range(100):
        await store.acquire_lease(f"streams:{i}", "a", 1, 1)
    await store.take([Bucket("quota:small", 1, 1)], [1])  # lives MIN_BUCKET_TTL_S
    assert len(store) == 101
    clock.advance(max(SWEEP_INTERVAL_S, MIN_BUCKET_TTL_S))
    await store.acquire_lease("streams:fresh", "a", 1, 60)
    assert len(store) == 1


async def test_a_write_sweeps_a_bounded_batch_of_expired_keys(
    store: MemoryStore, clock: Clock
) -> None:
    for i in range(3 * SWEEP_BATCH + 10):
        await store.acquire_lease(f"streams:{i}", "a", 1, 1)
    clock.advance(SWEEP_INTERVAL_S)
    probe = Bucket("quota:probe", 10, 1)
    await store.take([probe], [1])  # no write scans the keyspace: one batch per write
    assert len(store) == 1 + 2 * SWEEP_BATCH + 10
    for _ in range(3):
        await store.take([probe], [1])
    assert len(store) == 1


async def test_a_key_written_again_outlives_its_first_expiry(
    store: MemoryStore, clock: Clock
) -> None:
    b = Bucket("quota:b", capacity=100, refill_per_s=1)
    await store.take([b], [1])  # 99 left: the key would expire in MIN_BUCKET_TTL_S
    clock.advance(4)
    await store.take([b], [50])  # 50 left: it now lives 100 s
    clock.advance(SWEEP_INTERVAL_S)
    await store.acquire_lease("streams:other", "a", 1, 60)  # a write, due to sweep
    assert await store.peek([b]) == (60.0,)


async def test_a_key_whose_expiry_moves_earlier_is_swept_by_then(
    store: MemoryStore, clock: Clock
) -> None:
    await store.acquire_lease("streams:s", "long", 2, 60)
    await store.acquire_lease("streams:s", "short", 2, 1)
    await store.release_lease("streams:s", "long")  # the key now expires in 1 s, not 60 s
    clock.advance(SWEEP_INTERVAL_S)
    await store.take([Bucket("quota:probe", 10, 1)], [1])
    assert len(store) == 1


async def test_bucket_expiry_is_invisible(store: MemoryStore, clock: Clock) -> None:
    b = Bucket("b", capacity=10, refill_per_s=1)
    assert (await store.take([b], [10])).granted
    clock.advance(20)  # twice the time to refill from empty: the key is gone, the bucket full
    # The key expired: using it as a lease set would raise StoreError if it still held the bucket.
    assert await store.acquire_lease("b", "a", 1, 10) == (True, 1)
    await store.release_lease("b", "a")
    assert await store.peek([b]) == (10.0,)


def test_build_store_without_a_redis_url_is_embedded() -> None:
    assert isinstance(build_store(StoreConfig()), MemoryStore)
