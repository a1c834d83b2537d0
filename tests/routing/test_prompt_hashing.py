"""The routing seam that names a prompt's blocks as the pool's engine does, chosen per pool.

vLLM's side against a running engine: ``tests/vllm/test_prompt_hashes_vllm.py``; its hashing
against fixed vectors: ``tests/kvcache/test_vllm_block_hashes.py``.
"""

from __future__ import annotations

from serve_app import tokenizer
from serve_app.adapters import ADAPTER_KEY
from serve_app.config.models import PoolConfig
from serve_app.kvcache.block_hashes import prefix_block_hashes
from serve_app.routing.prompt_hashing import (
    SimulatedPromptHasher,
    build_prompt_hasher,
    for_pool,
    vllm_messages,
    vllm_tools,
)

BODY = {"prompt": "Forge routes each prompt to the replica that holds its prefix. " * 4}


def vllm_pool(**extra) -> PoolConfig:
    return PoolConfig.model_validate(
        {
            "model": "tiny",
            "engine": {"kind": "vllm", "model": "/models/tiny", **extra},
            "adapters": [{"name": "support", "path": "/adapters/support"}],
            "deployment": {
                "ray_actor_options": {"runtime_env": {"env_vars": {"PYTHONHASHSEED": "7"}}}
            },
        }
    )


def test_a_simulated_pool_keeps_the_simulators_tokens_and_chain():
    options = for_pool(PoolConfig(model="sim"))
    hasher = build_prompt_hasher(options, block_size=4, route_blocks=128)

    route = hasher.route({**BODY, ADAPTER_KEY: "support"}, "completion")

    assert isinstance(hasher, SimulatedPromptHasher) and not hasher.keys_adapters
    ids = tokenizer.encode(BODY["prompt"])
    assert route.block_hashes == prefix_block_hashes(ids, 4)
    assert (route.prompt_tokens, route.adapter) == (len(ids), "support")


def test_a_vllm_pool_hashes_with_its_models_directory_its_adapters_and_its_seed():
    options = for_pool(vllm_pool(engine_args={"prefix_caching_hash_algo": "sha256_cbor"}))

    assert options == {
        "kind": "vllm",
        "model_dir": "/models/tiny",
        "served_model": "tiny",
        "adapters": {"support": "/adapters/support"},
        "algo": "sha256_cbor",
        "seed": "7",  # where its replicas run: what their vLLM seeds its chain with
        "chat_template": None,
        "chat_template_kwargs": None,
    }
    assert for_pool(vllm_pool())["algo"] == "sha256"


def test_a_vllm_pool_whose_model_the_gateway_cannot_read_is_routed_by_load_alone(tmp_path):
    options = {**for_pool(vllm_pool()), "model_dir": str(tmp_path / "absent")}
    hasher = build_prompt_hasher(options, block_size=4, route_blocks=128)

    route = hasher.route({**BODY, ADAPTER_KEY: "support"}, "completion")

    # Not the simulator's hashes: they would never meet a vLLM replica's blocks.
    assert route.block_hashes == ()
    assert route.adapter == "support"


def test_tools_are_shaped_as_vllm_dumps_them_for_the_template():
    """As vLLM 0.32's ``ChatCompletionRequest`` parses and ``tool.model_dump()`` gives them."""
    sent = [
        {"type": "function", "function": {"name": "a"}},
        {"type": "function", "function": {"name": "a", "strict": None}},
        {"type": "function", "function": {"description": "x", "strict": True, "name": "a"}},
        {"function": {"parameters": {"b": 1, "a": 2}, "name": "a"}, "type": "function"},
        {"type": "function", "function": {"name": "a", "defer_loading": True}},
    ]

    assert vllm_tools(sent) == [
        {"type": "function", "function": {"name": "a", "description": None, "parameters": None}},
        {"type": "function", "function": {"name": "a", "description": None, "parameters": None}},
        {
            "type": "function",
            "function": {"name": "a", "description": "x", "parameters": None, "strict": True},
        },
        {
            "type": "function",
            "function": {"name": "a", "description": None, "parameters": {"b": 1, "a": 2}},
        },
        {
            "type": "function",
            "function": {
                "name": "a",
                "description": None,
                "parameters": None,
                "defer_loading": True,
            },
        },
    ]
    # Key order is what a template's tojson prints.
    assert [list(t["function"]) for t in vllm_tools(sent[3:4])] == [
        ["name", "description", "parameters"]
    ]


def test_messages_are_shaped_as_vllm_hands_them_to_the_template():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    sent = [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
        {"role": "tool", "tool_call_id": "c1", "content": "done", "name": "f"},
        {"role": "assistant", "content": "", "tool_calls": []},
        {
            "role": "assistant",
            "tool_calls": [{**call, "function": {"name": "f", "arguments": "[1]"}}],
        },
    ]

    assert vllm_messages(sent) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
            ],
        },
        {"role": "tool", "content": "done", "tool_call_id": "c1", "name": "f"},
        {"role": "assistant", "content": ""},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
            ],
        },
    ]
    assert call["function"]["arguments"] == '{"a":1}', "the body itself is left as sent"
