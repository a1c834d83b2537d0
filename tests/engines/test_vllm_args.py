"""Forge's config as vLLM's arguments, without vLLM (``vllm_server_args`` sets these on vLLM's
own parser; ``tests/vllm/test_vllm_engine.py`` checks its refusal of unknown names)."""

from __future__ import annotations

from serve_app.config.models import VLLMEngineConfig
from serve_app.engines.vllm_args import vllm_settings


def config(**fields) -> VLLMEngineConfig:
    return VLLMEngineConfig(kind="vllm", model="/models/tiny", **fields)


def test_the_configs_fields_under_vllms_names_served_as_the_pools_model():
    settings = vllm_settings(
        "forge-tiny",
        config(
            max_num_seqs=8,
            block_size=32,
            max_model_len=2048,
            dtype="bfloat16",
            enforce_eager=True,
            enable_prefix_caching=False,
            gpu_memory_utilization=0.5,
        ),
    )

    assert settings == {
        "model": "/models/tiny",
        "served_model_name": ["forge-tiny"],
        "max_num_seqs": 8,
        "block_size": 32,
        "max_model_len": 2048,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "gpu_memory_utilization": 0.5,
        "enable_prompt_tokens_details": True,
    }


def test_prompt_token_details_are_on_so_usage_carries_cached_tokens():
    assert vllm_settings("m", config())["enable_prompt_tokens_details"] is True
    assert vllm_settings("m", config(), "embed")["enable_prompt_tokens_details"] is True


def test_an_embedding_pool_runs_vllms_pooling_runner():
    assert vllm_settings("m", config(), "embed")["runner"] == "pooling"
    assert "runner" not in vllm_settings("m", config(), "generate")  # vLLM's own default


def test_engine_args_are_passed_on_and_have_the_last_word():
    engine_args = {
        "kv_cache_memory_bytes": 268435456,
        "runner": "generate",
        "enable_prompt_tokens_details": False,
    }

    settings = vllm_settings("m", config(engine_args=engine_args), "embed")

    assert settings["kv_cache_memory_bytes"] == 268435456
    assert settings["runner"] == "generate"
    assert settings["enable_prompt_tokens_details"] is False
    assert settings["served_model_name"] == ["m"]


def test_a_pools_adapters_are_vllms_lora_modules_under_their_forge_names():
    from serve_app.config.models import AdapterConfig

    config = VLLMEngineConfig(kind="vllm", model="/models/qwen", max_loras=3, max_lora_rank=32)
    adapters = [AdapterConfig(name="support", path="/weights/support")]
    settings = vllm_settings("qwen", config, adapters=adapters)
    assert settings["enable_lora"] is True
    assert (settings["max_loras"], settings["max_lora_rank"]) == (3, 32)
    assert settings["lora_modules"] == [{"name": "qwen:support", "path": "/weights/support"}]
    assert "enable_lora" not in vllm_settings("qwen", config)  # no adapters, no LoRA
