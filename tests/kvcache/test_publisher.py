"""A replica's KV-event sockets against the peers that may reach them: only holders of the
cluster's key get events or snapshots, a peer's requests are capped in size and rate, and the
replica keeps serving its routers through all of it. Real ZeroMQ on 127.0.0.x, no Ray."""

from __future__ import annotations

import contextlib

import pytest
import zmq

from serve_app.kvcache.curve import CurveKeys
from serve_app.kvcache.events import (
    SNAPSHOT_REQUEST,
    EngineLoad,
    KvEventPublisher,
    PeerRateLimit,
    decode,
    parse_snapshot,
)
from serve_app.routing.kv_index import KvIndex
from tests.kvcache.peers import Client, first_event, receive
from tests.polling import eventually_async


@pytest.fixture
def keys() -> CurveKeys:
    return CurveKeys.generate()


@pytest.fixture
async def publisher(keys):
    """A replica's publisher behind CURVE, holding ``blocks``, with a small snapshot budget."""
    blocks: set[int] = set()
    pub = KvEventPublisher(
        "r1", lambda: blocks, keys=keys, snapshot_burst=3, snapshot_rate_per_s=0.01
    )
    pub.blocks = blocks
    pub.start()
    yield pub
    await pub.close()


@pytest.fixture
def clients():
    made: list[Client] = []

    def client(keys: CurveKeys | None, **options) -> Client:
        made.append(Client(keys, **options))
        return made[-1]

    yield client
    for client_ in made:
        client_.close()


async def until(condition, what: str) -> None:
    await eventually_async(condition, timeout_s=10, what=what, interval_s=0.01)


async def test_a_peer_with_the_key_gets_events_and_snapshots(publisher, keys, clients):
    peer = clients(keys)
    sub = peer.socket(zmq.SUB, publisher.endpoint)
    assert (await first_event(publisher, sub))["epoch"] == publisher.epoch
    dealer = peer.socket(zmq.DEALER, publisher.snapshot_endpoint)
    await dealer.send(SNAPSHOT_REQUEST)
    reply = await receive(dealer, 10)
    assert reply is not None and parse_snapshot(reply[0], 100).epoch == publisher.epoch


async def test_a_peer_without_the_key_gets_nothing_and_is_counted(publisher, keys, clients):
    plaintext = clients(None)
    # A stranger that knows the replica's public key (it is public) but holds another secret.
    stranger = clients(CurveKeys.generate(), server_key=keys.public)
    outsiders = [
        plaintext.socket(zmq.SUB, publisher.endpoint),
        plaintext.socket(zmq.DEALER, publisher.snapshot_endpoint),
        stranger.socket(zmq.SUB, publisher.endpoint),
        stranger.socket(zmq.DEALER, publisher.snapshot_endpoint),
    ]
    for dealer in outsiders[1::2]:
        # Not waited for: a DEALER whose only connection was refused has no peer to queue to,
        # and a blocking send then waits for ever (CI hung here once, 900 s).
        with contextlib.suppress(zmq.Again):
            await dealer.send(SNAPSHOT_REQUEST, zmq.NOBLOCK)
    # Refused at the handshake: by mechanism (plaintext), by ZAP (the stranger's key).
    await until(lambda: publisher.rejected["unauthenticated"] >= 4, "refused handshakes")
    # A router with the key gets what is published meanwhile; the outsiders get none of it.
    router = clients(keys).socket(zmq.SUB, publisher.endpoint)
    await first_event(publisher, router)
    for sock in outsiders:
        assert await receive(sock, 0.2) is None
    assert publisher.rejected.keys() == {"unauthenticated"}


async def test_plaintext_is_refused_beyond_loopback():
    with pytest.raises(ValueError, match="plaintext"):
        KvEventPublisher("r1", lambda: [], host="0.0.0.0")


async def test_a_snapshot_flood_is_rate_limited_and_routers_still_sync(publisher, keys, clients):
    """200 requests from one address (another host: 127.0.0.2) get the burst's 3 answers;
    a router elsewhere still syncs the replica and follows its events."""
    flooder = clients(keys, source="127.0.0.2").socket(zmq.DEALER, publisher.snapshot_endpoint)
    for _ in range(200):
        await flooder.send(SNAPSHOT_REQUEST)
    await until(lambda: publisher.rejected["rate_limited"] == 197, "the flood's refusals")
    answers = 0
    while await receive(flooder, 0.2) is not None:
        answers += 1
    assert answers == 3

    index = KvIndex("primary", keys=keys)
    try:
        publisher.blocks.update({1, 2})  # as an engine caches blocks: in its set, published
        publisher.stored([1, 2])
        publisher.flush(EngineLoad())
        index.watch("r1", publisher.endpoint, publisher.snapshot_endpoint)
        await until(lambda: index.blocks("r1") == {1, 2}, "the router's snapshot")
        publisher.blocks.add(3)
        publisher.stored([3])
        publisher.flush(EngineLoad())
        await until(lambda: 3 in index.blocks("r1"), "the router to apply an event")
    finally:
        index.close()
    assert publisher.rejected["rate_limited"] == 197  # the router's own request was answered


async def test_a_request_that_is_not_a_snapshot_request_is_counted_not_answered(
    publisher, keys, clients
):
    dealer = clients(keys).socket(zmq.DEALER, publisher.snapshot_endpoint)
    await dealer.send(b"give me everything")
    await until(lambda: publisher.rejected["malformed"] == 1, "the refusal")
    assert await receive(dealer, 0.2) is None


async def test_an_oversized_request_is_dropped_before_it_is_read(publisher, keys, clients):
    """A frame over the replica's cap (4 KiB) ends the peer's connection: the snapshot request
    after it is never seen. A fresh connection is served as ever."""
    dealer = clients(keys).socket(zmq.DEALER, publisher.snapshot_endpoint)
    await dealer.send_multipart([b"x" * 100_000, SNAPSHOT_REQUEST])
    assert await receive(dealer, 0.5) is None
    assert sum(publisher.rejected.values()) == 0  # never read, so never counted as a request
    fresh = clients(keys).socket(zmq.DEALER, publisher.snapshot_endpoint)
    await fresh.send(SNAPSHOT_REQUEST)
    assert await receive(fresh, 10) is not None


@pytest.mark.parametrize("count", [0, 5, 40_000])
async def test_a_snapshot_encoded_in_chunks_is_the_whole_block_set(keys, clients, count):
    blocks = list(range(2**63, 2**63 + count))
    pub = KvEventPublisher("r1", lambda: blocks, keys=keys)
    pub.start()
    try:
        dealer = clients(keys).socket(zmq.DEALER, pub.snapshot_endpoint)
        await dealer.send(SNAPSHOT_REQUEST)
        (raw,) = await receive(dealer, 10)
        assert decode(raw) == {
            "v": 1,
            "epoch": pub.epoch,
            "seq": 0,
            "load": {"backlog": 0, "running": 0, "waiting": 0, "slots": 1},
            "blocks": blocks,
        }
    finally:
        await pub.close()


async def test_a_snapshot_is_cut_to_what_fits_the_routers_cap(keys, clients):
    blocks = list(range(2**63, 2**63 + 20_000))
    pub = KvEventPublisher("r1", lambda: blocks, keys=keys, max_message_bytes=64 * 1024)
    pub.start()
    try:
        dealer = clients(keys).socket(zmq.DEALER, pub.snapshot_endpoint)
        await dealer.send(SNAPSHOT_REQUEST)
        (raw,) = await receive(dealer, 10)
        assert len(raw) <= 64 * 1024
        assert decode(raw)["blocks"] == blocks[: (64 * 1024 - 1024) // 9]
    finally:
        await pub.close()


async def test_a_message_over_the_routers_cap_is_skipped_so_they_resync(keys, clients):
    pub = KvEventPublisher("r1", lambda: [], keys=keys, max_message_bytes=64 * 1024)
    try:
        sub = clients(keys).socket(zmq.SUB, pub.endpoint)
        first = await first_event(pub, sub)
        pub.stored(range(2**63, 2**63 + 20_000))  # ~180 kB: the routers would drop it
        pub.flush(EngineLoad())
        pub.stored([1])
        pub.flush(EngineLoad())
        (_, raw) = await receive(sub, 10)
        after = decode(raw)
        assert after["seq"] == first["seq"] + 2  # the gap that makes a router ask for a snapshot
        assert after["ops"] == [["s", [1]]]
    finally:
        await pub.close()


def test_each_peer_has_its_own_bucket():
    now = [0.0]
    limit = PeerRateLimit(burst=2, rate_per_s=1.0, clock=lambda: now[0], max_peers=2)
    assert [limit.allow("a") for _ in range(3)] == [True, True, False]
    assert limit.allow("b")  # another address, another bucket
    now[0] = 1.0
    assert limit.allow("a") and not limit.allow("a")  # one a second after the burst
    now[0] = 100.0
    assert [limit.allow("a") for _ in range(3)] == [True, True, False]  # refilled to the burst


def test_the_rate_limit_remembers_a_bounded_number_of_peers():
    limit = PeerRateLimit(burst=1, rate_per_s=0.001, clock=lambda: 0.0, max_peers=2)
    assert limit.allow("a") and not limit.allow("a")
    limit.allow("b")
    limit.allow("c")  # "a" is forgotten: it comes back with a full bucket
    assert limit.allow("a")
    assert len(limit._buckets) == 2
