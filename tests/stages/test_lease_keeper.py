"""One keeper renews the stream leases of every live request: lifetimes, and a lease taken back
for a stream that ended meanwhile. Renewals are sent by hand (``renew_now``), on fake clocks."""

from __future__ import annotations

from serve_app.stages.lease_keeper import LeaseKeeper
from serve_app.stages.store_failures import StoreFailures
from serve_app.store import MemoryStore
from tests.doubles import Clock, RecordingMetrics

TTL_S = 60.0
KEY = "streams:{acme}"


def keeper(clock: Clock) -> LeaseKeeper:
    return LeaseKeeper(TTL_S, StoreFailures(RecordingMetrics(), "test"), clock=clock)


async def test_a_lease_is_renewed_until_its_longest_life_then_lapses():
    clock = Clock(1000.0)
    store, leases = MemoryStore(clock=clock), keeper(clock)
    assert await store.acquire_lease(KEY, "long", 1, TTL_S) == (True, 1)
    leases.keep(store, KEY, "long", 1, max_life_s=300)
    for _ in range(14):  # 280 s: four and a half TTLs, renewed every third of one
        clock.advance(TTL_S / 3)
        await leases.renew_now()
    assert await store.acquire_lease(KEY, "other", 1, TTL_S) == (False, 1)
    clock.advance(TTL_S / 3)  # past its life: renewed no more
    await leases.renew_now()
    assert leases.kept == 0
    clock.advance(TTL_S)
    assert await store.acquire_lease(KEY, "other", 1, TTL_S) == (True, 1), "it lapsed"


async def test_a_lost_lease_whose_stream_ends_during_its_take_back_is_given_back():
    clock = Clock(1000.0)
    leases = keeper(clock)

    class EndsDuringTakeBack(MemoryStore):
        async def acquire_lease(self, key, lease_id, limit, ttl_s):
            leases.drop(lease_id)  # the request ended while the call was under way
            return await super().acquire_lease(key, lease_id, limit, ttl_s)

    store = EndsDuringTakeBack(clock=clock)
    leases.keep(store, KEY, "lost", 1, max_life_s=300)  # the store never saw it (flushed)
    await leases.renew_now()
    assert await MemoryStore.acquire_lease(store, KEY, "next", 1, TTL_S) == (True, 1)
