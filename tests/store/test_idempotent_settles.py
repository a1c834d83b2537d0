"""Settles that may be retried (the store contract, both stores): a refund carrying an id is
applied once however often it is sent, as a retry after a lost reply must be."""

from __future__ import annotations

import pytest

from serve_app.store import Bucket, Store

BUCKET = Bucket("{t}:tokens", capacity=1000, refill_per_s=0.001)


async def test_a_refund_sent_twice_with_one_id_is_applied_once(store: Store) -> None:
    assert (await store.take([BUCKET], [600])).granted
    level = await store.adjust(BUCKET, 200, once="settle-1")
    assert level == pytest.approx(600, abs=1)
    # The retry of a refund whose reply was lost: nothing more, and the level as it stands.
    assert await store.adjust(BUCKET, 200, once="settle-1") == pytest.approx(600, abs=1)
    (now,) = await store.peek([BUCKET])
    assert now == pytest.approx(600, abs=1)


async def test_refunds_with_different_ids_or_none_each_apply(store: Store) -> None:
    assert (await store.take([BUCKET], [600])).granted
    await store.adjust(BUCKET, 100, once="a")
    await store.adjust(BUCKET, 100, once="b")
    await store.adjust(BUCKET, 100)
    await store.adjust(BUCKET, 100)
    (now,) = await store.peek([BUCKET])
    assert now == pytest.approx(800, abs=1)


async def test_a_charge_with_an_id_is_applied_once_too(store: Store) -> None:
    await store.adjust(BUCKET, -300, once="overshoot")
    await store.adjust(BUCKET, -300, once="overshoot")
    (now,) = await store.peek([BUCKET])
    assert now == pytest.approx(700, abs=1)


async def test_a_settle_refunds_once_and_gives_the_lease_back_however_often_it_is_sent(
    store: Store,
) -> None:
    """A request's end in one call (one round trip on Redis): its refund, once, and its stream
    lease back; a retry after a lost reply changes nothing more."""
    reserved = await store.reserve([BUCKET], [600], "{t}:streams", "req-1", 1, 60)
    assert reserved.refused is None
    assert await store.acquire_lease("{t}:streams", "req-2", 1, 60) == (False, 1)
    for _ in range(2):
        await store.settle(BUCKET, 450, "req-1", "{t}:streams", "req-1")
        (now,) = await store.peek([BUCKET])
        assert now == pytest.approx(850, abs=1)
        assert await store.acquire_lease("{t}:streams", "req-2", 1, 60) == (True, 1)
