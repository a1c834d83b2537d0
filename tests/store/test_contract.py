"""One contract, two stores: every test here runs against MemoryStore and RedisStore.

Time passes through ``passing`` (``Passage``): on the memory store it is a hand-driven clock, so
its timing tests are exact and instant; on Redis the clock is the server's and only real time
moves it, so there it sleeps. A busy machine may oversleep by any amount, so what a Redis timing
test asserts either holds however late it wakes (an expiry has happened) or is bracketed by the
time the test measured around the calls (a refill), and anything that must still be alive when
the test looks has a TTL many times the wait.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from uuid import uuid4

import pytest

from serve_app.store import Bucket, MemoryStore, Store, StoreError
from tests.doubles import Clock

SLOW = 1e-6  # a refill rate that is negligible over a test's lifetime
SKEW_S = 0.005  # the Redis server's clock against ours over a test (same host; µs in practice)


class Passage:
    """Lets time pass for the store under test, and reads the time it keeps.

    ``clock`` is the memory store's (moved only by ``elapse``) or, for Redis, this host's
    monotonic clock: a reading before a call and one after it bracket the server's ``TIME`` in it.
    """

    def __init__(self, clock: Clock | None) -> None:
        self._clock = clock

    def now(self) -> float:
        return time.monotonic() if self._clock is None else self._clock()

    async def elapse(self, seconds: float) -> None:
        if self._clock is None:
            await asyncio.sleep(seconds)  # Redis keeps the server's time: only real time moves it
        else:
            self._clock.advance(seconds)

    @property
    def skew_s(self) -> float:
        return SKEW_S if self._clock is None else 0.0


@pytest.fixture
def clock() -> Clock:
    return Clock(1000.0)


@pytest.fixture
async def store(store: Store, clock: Clock) -> AsyncIterator[Store]:
    """The conftest's stores, the memory one replaced by one on the hand-driven clock."""
    yield MemoryStore(clock=clock) if isinstance(store, MemoryStore) else store


@pytest.fixture
def passing(store: Store, clock: Clock) -> Passage:
    return Passage(clock if isinstance(store, MemoryStore) else None)


def bucket(capacity: float, refill_per_s: float = SLOW, name: str = "b") -> Bucket:
    return Bucket(f"quota:{name}", capacity, refill_per_s)


# -- take -----------------------------------------------------------------------------------


async def test_new_bucket_starts_full_and_take_reports_remaining(store: Store) -> None:
    b = bucket(10)
    assert await store.peek([b]) == pytest.approx((10,))
    result = await store.take([b], [3])
    assert result.granted
    assert result.retry_after_s == 0
    assert result.remaining == pytest.approx((7,), abs=1e-3)


async def test_concurrent_takes_never_overdraw(store: Store) -> None:
    b = bucket(50)
    results = await asyncio.gather(*(store.take([b], [1]) for _ in range(200)))
    assert sum(r.granted for r in results) == 50
    assert (await store.peek([b]))[0] == pytest.approx(0, abs=1e-3)


async def test_multi_bucket_take_is_all_or_nothing(store: Store) -> None:
    requests, tokens = bucket(10, name="rpm"), bucket(100, name="tpm")
    assert (await store.take([requests, tokens], [1, 80])).granted
    refused = await store.take([requests, tokens], [1, 30])
    assert not refused.granted
    assert refused.remaining == pytest.approx((9, 20), abs=1e-3)
    assert await store.peek([requests, tokens]) == pytest.approx((9, 20), abs=1e-3)


async def test_zero_amounts_are_allowed(store: Store) -> None:
    requests, tokens = bucket(10, name="rpm"), bucket(100, name="tpm")
    result = await store.take([requests, tokens], [1, 0])
    assert result.granted
    assert result.remaining == pytest.approx((9, 100), abs=1e-3)


async def test_retry_after_is_the_deficit_over_the_rate(store: Store, passing: Passage) -> None:
    b = bucket(10, refill_per_s=2)
    start = passing.now()
    assert (await store.take([b], [10])).granted
    refused = await store.take([b], [4])
    took_s = passing.now() - start + passing.skew_s
    assert not refused.granted
    # 4 tokens short at 2/s is 2 s, less whatever refilled between the two takes.
    assert 2.0 - 2 * took_s <= refused.retry_after_s <= 2.0
    assert refused.retry_after_s == pytest.approx((4 - refused.remaining[0]) / 2)


async def test_retry_after_is_the_slowest_bucket(store: Store, passing: Passage) -> None:
    fast, slow = bucket(10, refill_per_s=10, name="fast"), bucket(10, refill_per_s=1, name="slow")
    start = passing.now()
    assert (await store.take([fast, slow], [10, 10])).granted
    refused = await store.take([fast, slow], [5, 5])
    took_s = passing.now() - start + passing.skew_s
    assert not refused.granted
    # The slow bucket: 5 short at 1/s, less what refilled between the takes; the fast one's wait
    # would be a tenth of that.
    assert 5.0 - took_s <= refused.retry_after_s <= 5.0
    assert refused.retry_after_s == pytest.approx(5 - refused.remaining[1])


async def test_amount_above_capacity_can_never_succeed(store: Store) -> None:
    requests, tokens = bucket(10, name="rpm"), bucket(100, name="tpm")
    refused = await store.take([requests, tokens], [1, 101])
    assert not refused.granted
    assert math.isinf(refused.retry_after_s)
    assert await store.peek([requests, tokens]) == pytest.approx((10, 100))


async def test_refill_is_continuous_and_capped(store: Store, passing: Passage) -> None:
    b = bucket(100, refill_per_s=20)
    before_take = passing.now()
    assert (await store.take([b], [100])).granted
    after_take = passing.now()
    await passing.elapse(0.2)
    before_peek = passing.now()
    (level,) = await store.peek([b])
    after_peek = passing.now()
    # 20/s over however long passed between the take and the peek: 4 after exactly 0.2 s.
    shortest_s = before_peek - after_take - passing.skew_s
    longest_s = after_peek - before_take + passing.skew_s
    assert 20 * shortest_s - 1e-3 <= level <= min(100, 20 * longest_s) + 1e-3
    assert level >= 4 - 20 * passing.skew_s - 1e-3
    small = bucket(2, refill_per_s=50, name="small")
    assert (await store.take([small], [2])).granted
    await passing.elapse(0.2)  # 10 tokens' worth of refill into a bucket of 2
    assert await store.peek([small]) == pytest.approx((2,))


async def test_refused_take_changes_nothing(store: Store) -> None:
    b = bucket(5)
    assert (await store.take([b], [4])).granted
    for _ in range(3):
        assert not (await store.take([b], [2])).granted
    assert (await store.take([b], [1])).granted
    assert await store.peek([b]) == pytest.approx((0,), abs=1e-3)


# -- adjust and peek ------------------------------------------------------------------------


async def test_adjust_refund_is_capped_at_capacity(store: Store) -> None:
    b = bucket(100)
    assert (await store.take([b], [30])).granted
    assert await store.adjust(b, 20) == pytest.approx(90, abs=1e-3)
    assert await store.adjust(b, 50) == pytest.approx(100)
    assert await store.peek([b]) == pytest.approx((100,))


async def test_adjust_overshoot_is_debt_that_refill_repays(store: Store, passing: Passage) -> None:
    b = bucket(10, refill_per_s=50)
    start = passing.now()
    assert await store.adjust(b, -20) == pytest.approx(-10, abs=1e-3)  # from full: 10 - 20
    refused = await store.take([b], [1])
    took_s = passing.now() - start + passing.skew_s
    assert not refused.granted
    # In debt: 11 short at 50/s is 0.22 s, less what refilled between the adjust and the take.
    assert refused.remaining[0] < 0
    assert -10 - 1e-3 <= refused.remaining[0] <= -10 + 50 * took_s + 1e-3
    assert refused.retry_after_s == pytest.approx((1 - refused.remaining[0]) / 50)
    # Half as long again, for the server's clock against ours: oversleeping only refills more.
    await passing.elapse(refused.retry_after_s * 1.5)
    assert (await store.take([b], [1])).granted


async def test_peek_changes_nothing(store: Store) -> None:
    requests, tokens = bucket(10, name="rpm"), bucket(100, name="tpm")
    assert (await store.take([requests, tokens], [2, 40])).granted
    first = await store.peek([requests, tokens])
    second = await store.peek([requests, tokens])
    assert first == pytest.approx((8, 60), abs=1e-3)
    assert second == pytest.approx(first, abs=1e-3)
    assert (await store.take([requests, tokens], [8, 60])).granted


# -- leases ---------------------------------------------------------------------------------


async def test_lease_limit_holds_under_concurrency(store: Store) -> None:
    results = await asyncio.gather(
        *(store.acquire_lease("streams:t", f"req-{i}", 5, 10) for i in range(30))
    )
    granted = [r for r in results if r[0]]
    assert len(granted) == 5
    assert sorted(holders for _, holders in granted) == [1, 2, 3, 4, 5]
    assert all(holders == 5 for ok, holders in results if not ok)


async def test_release_frees_a_slot_and_is_idempotent(store: Store) -> None:
    assert await store.acquire_lease("streams:t", "a", 1, 10) == (True, 1)
    assert await store.acquire_lease("streams:t", "b", 1, 10) == (False, 1)
    await store.release_lease("streams:t", "a")
    await store.release_lease("streams:t", "a")
    await store.release_lease("streams:t", "never-held")
    await store.release_lease("streams:nobody", "a")
    assert await store.acquire_lease("streams:t", "b", 1, 10) == (True, 1)


async def test_reacquiring_a_held_lease_does_not_count_twice(store: Store) -> None:
    assert await store.acquire_lease("streams:t", "a", 2, 10) == (True, 1)
    assert await store.acquire_lease("streams:t", "a", 2, 10) == (True, 1)
    assert await store.acquire_lease("streams:t", "b", 2, 10) == (True, 2)


async def test_expired_lease_does_not_count_and_renew_extends(
    store: Store, passing: Passage
) -> None:
    # Both leases are taken for 0.3 s and "alive" is renewed for 10 s at once: a stall of 0.3 s
    # between those calls would fail it, and the wait below may oversleep by seconds. (It once
    # took both for 0.2 s, renewed after 0.1 s for 0.4 s and looked at 0.3 s: a loaded machine
    # oversleeping by 0.2 s expired "alive" too.)
    assert await store.acquire_lease("streams:t", "crashed", 2, 0.3) == (True, 1)
    assert await store.acquire_lease("streams:t", "alive", 2, 0.3) == (True, 2)
    assert await store.renew_lease("streams:t", "alive", 10)
    await passing.elapse(0.45)  # "crashed" expired however late this wakes; "alive" was renewed
    assert not await store.renew_lease("streams:t", "crashed", 10)
    assert await store.acquire_lease("streams:t", "new", 2, 10) == (True, 2)
    assert await store.acquire_lease("streams:t", "late", 2, 10) == (False, 2)


async def test_renew_leases_renews_every_held_one_at_once_and_names_those_gone(
    store: Store, passing: Passage
) -> None:
    """A gateway's live streams of several tenants, renewed in one call: the held ones live on,
    the released and unknown ones are named (and not brought back)."""
    for key, lease_id in [("streams:t", "a"), ("streams:t", "done"), ("streams:u", "c")]:
        assert (await store.acquire_lease(key, lease_id, 2, 0.3))[0]
    await store.release_lease("streams:t", "done")
    asked = [
        ("streams:t", "a"),
        ("streams:u", "c"),
        ("streams:t", "done"),
        ("streams:u", "never"),
        ("streams:nobody", "x"),
    ]
    gone = await store.renew_leases(asked, 10)
    assert sorted(gone) == [("streams:nobody", "x"), ("streams:t", "done"), ("streams:u", "never")]
    await passing.elapse(0.45)  # past the first TTL however late this wakes: renewed ones live
    assert await store.acquire_lease("streams:t", "new", 2, 10) == (True, 2)  # "a" holds one
    assert await store.acquire_lease("streams:t", "late", 2, 10) == (False, 2)
    assert await store.acquire_lease("streams:u", "z", 2, 10) == (True, 2)  # "c" and "z" only
    assert await store.renew_leases([], 10) == []


# -- reserve: a take and a lease together ---------------------------------------------------


async def test_reserve_takes_and_leases_together(store: Store) -> None:
    requests, tokens = bucket(10, name="r"), bucket(100, name="t")
    reserved = await store.reserve([requests, tokens], [1, 30], "streams:t", "a", 2, 10)
    assert reserved.refused is None and reserved.holders == 1
    assert reserved.take.granted and reserved.take.remaining == pytest.approx((9, 70))
    assert await store.peek([requests, tokens]) == pytest.approx((9, 70))
    assert await store.acquire_lease("streams:t", "b", 2, 10) == (True, 2)  # "a" holds one


async def test_a_refused_lease_takes_nothing_from_the_buckets(store: Store) -> None:
    """The point of one call: a request over its stream cap owes no refund afterwards."""
    requests, tokens = bucket(10, name="r"), bucket(100, name="t")
    assert await store.acquire_lease("streams:t", "held", 1, 10) == (True, 1)
    reserved = await store.reserve([requests, tokens], [1, 30], "streams:t", "b", 1, 10)
    assert reserved.refused == "lease" and reserved.holders == 1 and not reserved.take.granted
    assert reserved.take.remaining == pytest.approx((10, 100))
    assert await store.peek([requests, tokens]) == pytest.approx((10, 100))
    await store.release_lease("streams:t", "held")
    assert (await store.reserve([requests], [1], "streams:t", "b", 1, 10)).refused is None


async def test_refused_buckets_leave_the_lease_unasked(store: Store) -> None:
    tokens = bucket(10, name="t")
    reserved = await store.reserve([tokens], [30], "streams:t", "a", 5, 10)
    assert reserved.refused == "buckets" and reserved.take.retry_after_s == math.inf
    assert await store.acquire_lease("streams:t", "b", 1, 10) == (True, 1)  # none was taken


async def test_concurrent_reserves_hold_both_limits(store: Store) -> None:
    tokens = bucket(100, name="t")
    results = await asyncio.gather(
        *(store.reserve([tokens], [10], "streams:t", f"req-{i}", 4, 10) for i in range(20))
    )
    made = [r for r in results if r.refused is None]
    assert len(made) == 4  # the lease cap binds first: 4 of 10 affordable
    assert await store.peek([tokens]) == pytest.approx((60,))
    assert {r.refused for r in results} == {None, "lease"}


# -- cache ----------------------------------------------------------------------------------


async def test_cache_round_trip_absent_and_overwrite(store: Store) -> None:
    assert await store.cache_get("cache:absent") is None
    await store.cache_put("cache:k", b"\x00\xffbinary", 10)
    assert await store.cache_get("cache:k") == b"\x00\xffbinary"
    await store.cache_put("cache:k", b"second", 10)
    assert await store.cache_get("cache:k") == b"second"
    await store.cache_put("cache:empty", b"", 10)
    assert await store.cache_get("cache:empty") == b""


async def test_cache_delete_says_whether_the_key_held_a_value(store: Store) -> None:
    await store.cache_put("cache:gone", b"v", 10)
    await store.cache_put("cache:kept", b"w", 10)
    assert await store.cache_delete("cache:gone") is True
    assert await store.cache_delete("cache:gone") is False
    assert await store.cache_delete("cache:never") is False
    assert await store.cache_get("cache:gone") is None
    assert await store.cache_get("cache:kept") == b"w"


async def test_cache_entry_expires_after_its_ttl(store: Store, passing: Passage) -> None:
    await store.cache_put("cache:short", b"v", 0.3)
    await store.cache_put("cache:long", b"v", 10)
    assert await store.cache_get("cache:short") == b"v"
    await passing.elapse(0.45)  # past the short TTL however late it wakes; far inside the long
    assert await store.cache_get("cache:short") is None
    assert await store.cache_get("cache:long") == b"v"


async def test_cache_put_replaces_a_key_of_any_kind(store: Store) -> None:
    await store.acquire_lease("leased", "a", 1, 10)
    await store.take([Bucket("bucketed", 10, SLOW)], [1])
    await store.cache_put("leased", b"v", 10)  # as Redis SET does
    await store.cache_put("bucketed", b"w", 10)
    assert await store.cache_get("leased") == b"v"
    assert await store.cache_get("bucketed") == b"w"


# -- errors ---------------------------------------------------------------------------------


async def test_wrong_kind_of_key_is_a_store_error(store: Store) -> None:
    await store.acquire_lease("mixed", "a", 1, 10)
    with pytest.raises(StoreError):
        await store.take([Bucket("mixed", 10, 1)], [1])
    await store.take([Bucket("bucket", 10, 1)], [1])
    with pytest.raises(StoreError):
        await store.acquire_lease("bucket", "a", 1, 10)


async def test_wrong_kind_of_key_for_the_cache_is_a_store_error(store: Store) -> None:
    bucketed = Bucket("bucketed", 10, SLOW)
    await store.cache_put("cached", b"v", 10)
    await store.take([bucketed], [4])
    await store.acquire_lease("leased", "a", 1, 10)
    with pytest.raises(StoreError):
        await store.cache_get("bucketed")
    with pytest.raises(StoreError):
        await store.cache_get("leased")
    with pytest.raises(StoreError):
        await store.take([Bucket("cached", 10, SLOW)], [1])
    with pytest.raises(StoreError):
        await store.acquire_lease("cached", "a", 1, 10)
    # Each refusal left every key as it was.
    assert await store.cache_get("cached") == b"v"
    assert await store.peek([bucketed]) == pytest.approx((6,), abs=1e-3)
    assert await store.acquire_lease("leased", "b", 1, 10) == (False, 1)


async def test_bad_arguments_are_value_errors(store: Store) -> None:
    b = bucket(10)
    with pytest.raises(ValueError):
        await store.take([b], [-1])
    with pytest.raises(ValueError):
        await store.take([b], [1, 2])
    with pytest.raises(ValueError):
        await store.acquire_lease("k", "a", 1, 0)
    with pytest.raises(ValueError):
        Bucket("k", -1, 1)
    with pytest.raises(ValueError):
        await store.cache_put("cache:k", b"v", 0)
    with pytest.raises(ValueError):
        await store.adjust(b, -math.inf)
    # Nothing of a refused call was applied: the bucket is full, the lease and the cache free.
    assert await store.peek([b]) == pytest.approx((10,))
    assert await store.acquire_lease("k", "b", 1, 10) == (True, 1)
    assert await store.cache_get("cache:k") is None


async def test_ping_and_close(store: Store) -> None:
    await store.ping()
    await store.take([Bucket(f"b:{uuid4().hex}", 1, 1)], [1])
