"""A router's KV index against whatever its replicas' sockets may send: garbage, messages of a
newer version, oversized frames, bad snapshots, publishers without the key. The index thread
skips and counts each, and goes on applying the good replicas' events. Real ZeroMQ, no Ray."""

from __future__ import annotations

import pytest

from serve_app.kvcache.curve import CurveKeys
from serve_app.kvcache.events import EngineLoad, KvEventPublisher, encode
from serve_app.routing import kv_index
from serve_app.routing.kv_index import KvIndex
from tests.kvcache.peers import SUBSCRIBE, UNSUBSCRIBE, RawPeer, event, snapshot
from tests.polling import eventually_async

RAW_EPOCH = 5


@pytest.fixture
def keys() -> CurveKeys:
    return CurveKeys.generate()


@pytest.fixture
async def good(keys):
    """A replica as Forge runs it, holding ``blocks``."""
    blocks: set[int] = set()
    pub = KvEventPublisher("good", lambda: blocks, keys=keys)
    pub.blocks = blocks
    pub.start()
    yield pub
    await pub.close()


@pytest.fixture
async def peers():
    made: list[RawPeer] = []

    def peer(keys: CurveKeys | None) -> RawPeer:
        made.append(RawPeer(keys))
        return made[-1]

    yield peer
    for peer_ in made:
        await peer_.close()


@pytest.fixture
def indexes(keys):
    """Routers' indexes, closed after the test; each thread must have lived until then."""
    made: list[KvIndex] = []

    def index(**options) -> KvIndex:
        made.append(KvIndex("primary", keys=keys, **options))
        return made[-1]

    yield index
    for index_ in made:
        assert index_._thread.is_alive()
        index_.close()


@pytest.fixture
def index(indexes) -> KvIndex:
    return indexes()


async def until(condition, what: str, index: KvIndex | None = None) -> None:
    explain = (lambda: dict(index.rejected)) if index is not None else None
    await eventually_async(condition, timeout_s=10, what=what, interval_s=0.01, explain=explain)


async def publish(publisher: KvEventPublisher, index: KvIndex, block: int) -> None:
    """The replica caches ``block`` and says so; wait for the index to hold it."""
    publisher.blocks.add(block)
    publisher.stored([block])
    publisher.flush(EngineLoad())
    await until(lambda: block in index.blocks(publisher.replica_id), f"block {block}", index)


async def watch_raw(index: KvIndex, raw: RawPeer, blocks=(1,)) -> None:
    """Subscribe the index to ``raw`` as replica "raw", synced to its snapshot."""
    raw.snapshot_reply = snapshot(RAW_EPOCH, 0, list(blocks))
    index.watch("raw", raw.endpoint, raw.snapshot_endpoint)
    assert await raw.subscription() == SUBSCRIBE
    await until(lambda: index.watching("raw"), "the raw peer's snapshot", index)


async def test_garbage_and_a_newer_version_are_skipped_and_counted_and_the_index_goes_on(
    good, peers, keys, index
):
    raw = peers(keys)  # holds the key: a newer replica during a roll, or a buggy one
    index.watch("good", good.endpoint, good.snapshot_endpoint)
    await watch_raw(index, raw)
    await publish(good, index, 1)

    # All of it under the good replica's name, where it would do the most harm if applied.
    raw.send(b"good", b"\xc1 not msgpack")
    raw.send(b"good")  # one frame
    raw.send(b"good", b"a", b"b")  # three
    raw.send(b"\xff\xfe", event(good.epoch, good.seq + 1))  # a name that is not UTF-8
    raw.send(b"good", encode({"epoch": "yesterday"}))
    raw.send(b"good", event(good.epoch, good.seq + 1, ops=[["s", ["not a hash"]]]))
    raw.send(b"good", event(good.epoch, good.seq + 1, [666], v=2))  # what v2 may mean: unknown
    await until(
        lambda: index.rejected == {"malformed": 6, "version": 1}, "the skipped messages", index
    )

    await publish(good, index, 2)  # the thread lived through it all
    assert 666 not in index.blocks("good")
    assert index.watching("raw")  # and the peer that sent it is still routed by its load


async def test_an_oversized_event_is_dropped_with_its_connection_not_the_index(
    peers, keys, indexes
):
    index = indexes(max_message_bytes=64 * 1024)
    raw = peers(keys)
    await watch_raw(index, raw)
    too_big = list(range(2**63, 2**63 + 20_000))  # 9 bytes a hash: 180 kB, over 64 KiB
    raw.send(b"raw", event(RAW_EPOCH, 1, too_big))
    # libzmq drops the connection before the message is read (and would leave it at that,
    # after a protocol error); the index connects again, and resyncs.
    assert await raw.subscription() == UNSUBSCRIBE
    assert await raw.subscription() == SUBSCRIBE
    await until(lambda: raw.snapshot_requests == 2, "the resync's snapshot request")
    raw.send(b"raw", event(RAW_EPOCH, 1, [2]))
    await until(lambda: 2 in index.blocks("raw"), "the next event", index)
    assert index.blocks("raw") == {1, 2}  # none of the oversized message's
    assert not index.rejected  # never read: nothing was decoded to count


async def test_a_bad_snapshot_is_skipped_and_asked_for_again(peers, keys, index, monkeypatch):
    monkeypatch.setattr(kv_index, "_SNAPSHOT_TIMEOUT_S", 0.2)
    raw = peers(keys)
    raw.snapshot_reply = b"\x93 junk"
    index.watch("raw", raw.endpoint, raw.snapshot_endpoint)
    await until(lambda: index.rejected["malformed"] >= 1, "a malformed snapshot", index)
    raw.snapshot_reply = snapshot(RAW_EPOCH, 0, [7], v=2)  # a newer replica's
    await until(lambda: index.rejected["version"] >= 1, "a snapshot of a newer version", index)
    assert not index.watching("raw")  # not synced: routed by its load alone
    raw.snapshot_reply = snapshot(RAW_EPOCH, 0, [7])
    await until(lambda: index.watching("raw"), "the good snapshot", index)
    assert index.blocks("raw") == {7}


async def test_the_index_believes_no_publisher_without_the_key(good, peers, keys, index):
    """A plaintext publisher, and one with another key (say, on a dead replica's port): the
    index's handshake with them fails, so it never subscribes nor takes their snapshots."""
    plaintext, stranger = peers(None), peers(CurveKeys.generate())
    for name, peer in (("plain", plaintext), ("stranger", stranger)):
        peer.snapshot_reply = snapshot(RAW_EPOCH, 0, [99])
        index.watch(name, peer.endpoint, peer.snapshot_endpoint)
    index.watch("good", good.endpoint, good.snapshot_endpoint)
    await publish(good, index, 1)
    for peer in (plaintext, stranger):
        with pytest.raises(TimeoutError):
            await peer.subscription(timeout_s=0.5)
        assert peer.snapshot_requests == 0
    assert not index.watching("plain") and not index.watching("stranger")
    assert index.rejected.keys() == {"unauthenticated"}  # each failed handshake, counted
