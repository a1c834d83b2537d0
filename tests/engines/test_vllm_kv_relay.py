"""The vLLM KV-event relay, without vLLM: what a router's index would be told.

The events are stand-ins named and shaped like vLLM's (the relay dispatches on the class name,
which is vLLM's wire tag); ``tests/vllm/test_kv_events_vllm.py`` checks vLLM's own events have
those names and fields, and runs the relay on a real engine.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field

import msgpack
import pytest
import zmq
import zmq.asyncio

from serve_app.engines.vllm_kv_relay import VllmKvEventRelay
from serve_app.kvcache.events import DEFAULT_MAX_MESSAGE_BYTES, EngineLoad, KvEventPublisher
from tests.polling import eventually_async

BLOCK = 2  # tokens per block


@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int = BLOCK
    extra_keys: list | None = None
    medium: str | None = "GPU"
    group_idx: int | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int | None = None


@dataclass
class AllBlocksCleared:
    pass


@dataclass
class Recorder:
    """The publisher's interface (``KvEventPublisher`` binds two TCP sockets when built):
    what the relay told it, in order."""

    ops: list[tuple] = field(default_factory=list)
    loads: list[EngineLoad] = field(default_factory=list)

    def stored(self, hashes) -> None:
        self.ops.append(("stored", list(hashes)))

    def removed(self, hashes) -> None:
        self.ops.append(("removed", list(hashes)))

    def cleared(self) -> None:
        self.ops.append(("cleared",))

    def accepted(self, request_id: str) -> None:
        self.ops.append(("accepted", request_id))

    def flush(self, load: EngineLoad) -> None:
        self.loads.append(load)


LOAD = EngineLoad(backlog=0, running=2, waiting=1, slots=8)


@pytest.fixture
def events() -> Recorder:
    return Recorder()


@pytest.fixture
def relay(events):
    relay = VllmKvEventRelay(events, lambda: LOAD)
    yield relay
    relay.remove_dir()


def test_the_recorder_has_the_publishers_calls():
    for name in ("stored", "removed", "cleared", "accepted", "flush"):
        ours = inspect.signature(getattr(Recorder, name)).parameters
        theirs = inspect.signature(getattr(KvEventPublisher, name)).parameters
        assert list(ours) == list(theirs), name


def test_stored_blocks_are_announced_under_vllms_own_names(relay, events):
    relay.apply([BlockStored([11, 12], None, [1, 2, 3, 4])])
    relay.apply([BlockStored([13], 12, [5, 6])])  # a later step, parented on vLLM's hash

    assert events.ops == [("stored", [11, 12]), ("stored", [13])]
    assert set(relay.held) == {11, 12, 13}


def test_blocks_keyed_by_more_than_tokens_are_announced_too(relay, events):
    # A LoRA's, a cache salt's or an image's blocks: the routers compute vLLM's keyed hashes.
    relay.apply(
        [
            BlockStored([21, 22], None, [1, 2, 3, 4], extra_keys=[("salt",), None]),
            BlockStored([34], 404, [9, 9]),  # a parent stored before the relay listened
        ]
    )

    assert events.ops == [("stored", [21, 22]), ("stored", [34])]


def test_a_digest_is_announced_by_its_low_64_bits_as_vllm_announces_ints(relay, events):
    digest = bytes(range(32))  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: raw digests

    relay.apply([BlockStored([digest], None, [1, 2]), BlockRemoved([digest])])

    low = int.from_bytes(digest[-8:], "big")
    assert events.ops == [("stored", [low]), ("removed", [low])]
    assert set(relay.held) == set()


def test_events_of_an_offload_tier_are_ignored(relay, events):
    relay.apply([BlockStored([11], None, [1, 2])])
    events.ops.clear()

    relay.apply(
        [
            BlockStored([51], None, [5, 6], medium="CPU"),
            BlockRemoved([11], medium="CPU"),  # the CPU tier's copy, not the GPU's
        ]
    )

    assert events.ops == []
    assert set(relay.held) == {11}


def test_no_medium_is_the_gpu(relay, events):
    relay.apply([BlockStored([11], None, [1, 2], medium=None)])

    assert events.ops == [("stored", [11])]


def test_removed_blocks_leave_the_snapshot(relay, events):
    relay.apply([BlockStored([11, 12], None, [1, 2, 3, 4])])
    events.ops.clear()

    relay.apply([BlockRemoved([12])])

    assert events.ops == [("removed", [12])]
    assert set(relay.held) == {11}


def test_clearing_empties_the_snapshot_and_announces_it(relay, events):
    relay.apply([BlockStored([11, 12], None, [1, 2, 3, 4])])

    relay.apply([AllBlocksCleared(), BlockStored([13], 12, [5, 6])])

    assert events.ops[1:] == [("cleared",), ("stored", [13])]
    assert set(relay.held) == {13}


def test_a_hybrid_models_block_is_announced_once_and_removed_with_its_last_group(relay, events):
    # Full attention (group 0) and a sliding window (group 1) cache the same blocks.
    relay.apply(
        [
            BlockStored([11, 12], None, [1, 2, 3, 4], group_idx=0),
            BlockStored([11, 12], None, [1, 2, 3, 4], group_idx=1),
        ]
    )
    assert events.ops == [("stored", [11, 12]), ("stored", [])]

    relay.apply([BlockRemoved([11], group_idx=1)])  # behind the window: group 0 still holds it
    assert events.ops[-1] == ("removed", [])
    assert set(relay.held) == {11, 12}

    relay.apply([BlockRemoved([11], group_idx=0), BlockRemoved([11], group_idx=0)])
    assert events.ops[-2:] == [("removed", [11]), ("removed", [])]
    assert set(relay.held) == {12}


def test_a_group_that_never_stored_a_block_cannot_remove_it(relay, events):
    relay.apply([BlockStored([11], None, [1, 2], group_idx=0)])

    relay.apply([BlockRemoved([11], group_idx=1), BlockRemoved([99], group_idx=0)])

    assert events.ops[1:] == [("removed", []), ("removed", [])]
    assert set(relay.held) == {11}


def test_a_block_computed_twice_is_held_until_its_last_copy_goes(relay, events):
    relay.apply([BlockStored([11], None, [1, 2]), BlockStored([11], None, [1, 2])])

    relay.apply([BlockRemoved([11])])
    assert events.ops == [("stored", [11]), ("stored", []), ("removed", [])]

    relay.apply([BlockRemoved([11])])
    assert events.ops[-1] == ("removed", [11])


def test_a_reset_the_replica_made_is_announced_at_once_with_the_load(relay, events):
    relay.apply([BlockStored([11], None, [1, 2])])

    relay.cleared()  # vLLM's own AllBlocksCleared waits for the engine's next step

    assert events.ops[1:] == [("cleared",)]
    assert events.loads == [LOAD]
    assert set(relay.held) == set()


def test_accepting_a_request_announces_it_with_the_engines_load(relay, events):
    relay.accepted("req-1-1")

    assert events.ops == [("accepted", "req-1-1")]
    assert events.loads == [LOAD]

    relay.flush()

    assert events.loads == [LOAD, LOAD]


class MsgpackRelay(VllmKvEventRelay):
    """The relay with a stand-in for vLLM's decoder: batches are msgpack lists of
    ``BlockStored`` fields. The socket and everything around the decoder are the relay's own."""

    def batch_decoder(self):
        return lambda payload: [BlockStored(**fields) for fields in msgpack.unpackb(payload)]


async def test_the_relay_outlives_an_oversized_or_garbled_batch(events):
    """What reaches the relay's socket is vLLM's, but a batch over the cap is dropped with its
    connection (which libzmq, after such an error, leaves dropped: the relay dials again) and
    one that does not decode is skipped; the next good batch is relayed."""
    relay = MsgpackRelay(events, lambda: LOAD)
    ctx = zmq.asyncio.Context()
    vllm = ctx.socket(zmq.XPUB)  # vLLM's side binds; an XPUB sees the relay (un)subscribe
    vllm.setsockopt(zmq.LINGER, 0)
    vllm.bind(relay.endpoint)
    relay.start()
    try:
        assert (await asyncio.wait_for(vllm.recv(), 10))[:1] == b"\x01"
        seq = iter(range(100))

        async def send(payload: bytes) -> None:
            await vllm.send_multipart([b"", next(seq).to_bytes(8, "big"), payload])

        await send(b"x" * (DEFAULT_MAX_MESSAGE_BYTES + 1))
        assert (await asyncio.wait_for(vllm.recv(), 10))[:1] == b"\x00"  # dropped ...
        assert (await asyncio.wait_for(vllm.recv(), 10))[:1] == b"\x01"  # ... and back
        await send(b"\xc1 not a batch")
        await send(
            msgpack.packb([{"block_hashes": [11], "parent_block_hash": None, "token_ids": [1, 2]}])
        )
        await eventually_async(
            lambda: events.ops, timeout_s=10, what="the good batch to be relayed"
        )
        assert events.ops == [("stored", [11])]
        assert relay.bad_batches == 1
    finally:
        await relay.close()
        vllm.close()
        ctx.term()
