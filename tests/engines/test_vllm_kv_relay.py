"""The vLLM KV-event relay's renaming, without vLLM: what a router's index would be told.

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
from serve_app.kvcache.block_hashes import chain_block_hash
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


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = "GPU"


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


def chain(*blocks: list[int], parent: int | None = None) -> list[int]:
    """Forge's names for consecutive blocks, the first chained from ``parent``."""
    names = []
    for tokens in blocks:
        parent = chain_block_hash(parent, tokens)
        names.append(parent)
    return names


def test_the_recorder_has_the_publishers_calls():
    for name in ("stored", "removed", "cleared", "accepted", "flush"):
        ours = inspect.signature(getattr(Recorder, name)).parameters
        theirs = inspect.signature(getattr(KvEventPublisher, name)).parameters
        assert list(ours) == list(theirs), name


def test_stored_blocks_get_forges_chained_names(relay, events):
    first, second = chain([1, 2], [3, 4])

    relay.apply([BlockStored([11, 12], None, [1, 2, 3, 4])])

    assert events.ops == [("stored", [first, second])]
    assert relay.forge_hashes == {11: first, 12: second}
    assert relay.skipped == 0


def test_a_later_block_is_chained_from_its_parents_forge_name(relay, events):
    relay.apply([BlockStored([11, 12], None, [1, 2, 3, 4])])
    events.ops.clear()

    relay.apply([BlockStored([13], 12, [5, 6])])  # a later step, parented on vLLM's hash

    (parent,) = chain([1, 2], [3, 4])[1:]
    assert events.ops == [("stored", chain([5, 6], parent=parent))]
    # The same name the whole prompt's chain gives its third block.
    assert relay.forge_hashes[13] == chain([1, 2], [3, 4], [5, 6])[2]


def test_a_block_whose_parent_is_unknown_is_skipped_and_counted(relay, events):
    # Stored on a parent cached before the relay listened: nothing to chain from.
    relay.apply([BlockStored([98, 99], 404, [7, 8, 9, 10])])

    assert events.ops == [("stored", [])]
    assert relay.forge_hashes == {}
    assert relay.skipped == 2


def test_blocks_keyed_by_more_than_tokens_are_skipped_with_the_rest_of_the_run(relay, events):
    relay.apply(
        [
            # A cache salt keys the first block, and so every block after it.
            BlockStored([21, 22], None, [1, 2, 3, 4], extra_keys=[("salt",), None]),
            # An image in the second block: the first is still plain tokens.
            BlockStored(
                [31, 32, 33], None, [1, 2, 7, 7, 8, 8], extra_keys=[None, ("img", 0), None]
            ),
            BlockStored([34], 32, [9, 9]),  # a child of a keyed block has no Forge parent
        ]
    )

    assert events.ops == [("stored", []), ("stored", chain([1, 2])), ("stored", [])]
    assert relay.forge_hashes == {31: chain([1, 2])[0]}
    assert relay.skipped == 2 + 2 + 1


def test_tokens_that_do_not_split_into_the_blocks_are_skipped(relay, events):
    # A run with null (sliding-window) blocks: fewer tokens than the blocks would hold.
    relay.apply([BlockStored([41, 42], None, [1, 2, 3])])

    assert events.ops == [("stored", [])]
    assert relay.forge_hashes == {}
    assert relay.skipped == 2


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
    assert relay.forge_hashes == {11: chain([1, 2])[0]}
    assert relay.skipped == 0


def test_no_medium_is_the_gpu(relay, events):
    relay.apply([BlockStored([11], None, [1, 2], medium=None)])

    assert events.ops == [("stored", chain([1, 2]))]


def test_removed_blocks_are_announced_under_forges_names(relay, events):
    first, second = chain([1, 2], [3, 4])
    relay.apply([BlockStored([11, 12], None, [1, 2, 3, 4])])
    events.ops.clear()

    relay.apply([BlockRemoved([12, 404])])  # 404: a block Forge never named

    assert events.ops == [("removed", [second])]
    assert relay.forge_hashes == {11: first}


def test_clearing_empties_the_map_and_announces_it(relay, events):
    relay.apply([BlockStored([11, 12], None, [1, 2, 3, 4])])

    relay.apply([AllBlocksCleared(), BlockStored([13], 12, [5, 6])])

    assert events.ops[1:] == [("cleared",), ("stored", [])]  # 12's name went with the clear
    assert relay.forge_hashes == {}
    assert relay.skipped == 1


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
        assert events.ops == [("stored", chain([1, 2]))]
        assert relay.bad_batches == 1
    finally:
        await relay.close()
        vllm.close()
        ctx.term()
