"""MemoryStore with a hand-driven clock: exact bucket arithmetic, and keys that really go away."""

from __future__ import annotations

import math

import pytest

from serve_app.config.models import StoreConfig
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


# -- cache size cap -------------------------------------------------------------------------


def entry(key: str, value: bytes) -> int:
    return len(key) + len(value)


async def test_cache_total_never_exceeds_the_cap(clock: Clock) -> None:
    store = MemoryStore(clock=clock, max_cache_bytes=100)
    for i in range(20):
        await store.cache_put(f"k{i:02d}", bytes(20), 60)  # 23 bytes each: four fit
        assert store.cache_bytes <= 100
    assert store.cache_bytes == 4 * 23
    assert [await store.cache_get(f"k{i:02d}") for i in range(15, 20)] == [None] + [bytes(20)] * 4


async def test_the_least_recently_used_entry_is_evicted_first(clock: Clock) -> None:
    store = MemoryStore(clock=clock, max_cache_bytes=3 * entry("a", bytes(9)))
    for key in "abc":
        await store.cache_put(key, bytes(9), 60)
    assert await store.cache_get("a") == bytes(9)  # a is now the most recently used
    await store.cache_put("d", bytes(9), 60)
    assert await store.cache_get("b") is None
    for key in "acd":
        assert await store.cache_get(key) == bytes(9)
    await store.cache_put("e", bytes(19), 60)  # twice the size: evicts the two oldest, a and c
    assert [await store.cache_get(key) for key in "acde"] == [None, None, bytes(9), bytes(19)]
    assert store.cache_bytes == entry("d", bytes(9)) + entry("e", bytes(19))


async def test_a_value_larger_than_the_cap_is_not_stored(clock: Clock) -> None:
    store = MemoryStore(clock=clock, max_cache_bytes=50)
    await store.cache_put("small", b"s", 60)
    await store.cache_put("big", b"old", 60)
    await store.cache_put("big", bytes(48), 60)  # 51 bytes: over the cap on its own
    assert await store.cache_get("big") is None  # and the old value is gone with the put
    assert await store.cache_get("small") == b"s"
    assert store.cache_bytes == entry("small", b"s")
    await store.cache_put("fits", bytes(46), 60)  # exactly the cap: evicts the rest
    assert await store.cache_get("fits") == bytes(46)
    assert store.cache_bytes == 50


async def test_overwrite_counts_only_the_new_value_and_never_evicts_itself(clock: Clock) -> None:
    store = MemoryStore(clock=clock, max_cache_bytes=50)
    await store.cache_put("k", bytes(10), 60)
    await store.cache_put("k", bytes(40), 60)  # 41 + the old 11 would exceed the cap
    assert await store.cache_get("k") == bytes(40)
    assert store.cache_bytes == entry("k", bytes(40))
    await store.cache_put("k", bytes(5), 60)
    assert store.cache_bytes == entry("k", bytes(5))
    assert len(store) == 1


async def test_cache_total_stays_right_through_expiry(store: MemoryStore, clock: Clock) -> None:
    await store.cache_put("read", b"r" * 10, 1)
    for i in range(10):
        await store.cache_put(f"cold:{i}", b"c" * 10, 1)
    await store.cache_put("kept", b"k" * 10, 600)
    clock.advance(1)
    assert await store.cache_get("read") is None  # expired on read
    assert store.cache_bytes == 10 * entry("cold:0", bytes(10)) + entry("kept", bytes(10))
    clock.advance(SWEEP_INTERVAL_S)
    await store.take([Bucket("quota:probe", 10, 1)], [1])  # a write sweeps the cold ones
    assert store.cache_bytes == entry("kept", bytes(10))
    assert len(store) == 2
    await store.cache_put("kept", b"k", 600)
    assert store.cache_bytes == entry("kept", b"k")


async def test_an_expired_cache_key_reused_as_another_kind_leaves_the_total(
    store: MemoryStore, clock: Clock
) -> None:
    await store.cache_put("k", bytes(10), 1)
    clock.advance(1)
    await store.acquire_lease("k", "a", 1, 60)
    assert store.cache_bytes == 0
    await store.cache_put("k", bytes(10), 60)  # and back: SET replaces the lease
    assert store.cache_bytes == entry("k", bytes(10))
    assert await store.cache_get("k") == bytes(10)


async def test_only_cache_entries_are_evicted(clock: Clock) -> None:
    store = MemoryStore(clock=clock, max_cache_bytes=20)
    b = Bucket("quota:b", 10, 1)
    await store.take([b], [4])
    await store.acquire_lease("streams:t", "a", 1, 60)
    await store.adjust(b, 1, once="settle-1")  # its id is a key too
    for i in range(50):
        await store.cache_put(f"c{i:02d}", bytes(7), 60)  # 10 bytes each: two fit
    assert store.cache_bytes == 20
    assert len(store) == 3 + 2
    assert await store.peek([b]) == (7.0,)
    assert await store.acquire_lease("streams:t", "b", 1, 60) == (False, 1)
    assert await store.adjust(b, 1, once="settle-1") == 7.0  # the id survived: not applied again


def test_build_store_without_a_redis_url_is_embedded() -> None:
    assert isinstance(build_store(StoreConfig()), MemoryStore)
