"""vLLM's server arguments from Forge's config: what ``vllm serve`` would have parsed.

Two halves, so that what Forge decides is testable where vLLM is not installed:
``vllm_settings`` is the config under vLLM's argument names (no vLLM import), and
``vllm_server_args`` sets those on the defaults of vLLM's own parser (needs vLLM), refusing any
``engine_args`` name that parser does not know.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from typing import Any, Literal

from serve_app.adapters import adapter_model
from serve_app.config.models import AdapterConfig, VLLMEngineConfig


def vllm_settings(
    model: str,
    config: VLLMEngineConfig,
    task: Literal["generate", "embed"] = "generate",
    adapters: Sequence[AdapterConfig] = (),
) -> dict[str, Any]:
    """The vLLM arguments Forge sets, by vLLM's (Python) names; ``engine_args`` has the last word.

    An embedding pool runs vLLM's pooling runner (a causal LM is converted to an embedding model,
    as ``--runner pooling`` does); ``engine_args`` may still name ``convert`` or ``pooler_config``.
    A pool's LoRA adapters are ``vllm serve --enable-lora --lora-modules``: each is served under
    its Forge name (``<model>:<adapter>``), which is what the engine puts in a request's
    ``model`` for vLLM's serving layer to attach its ``LoRARequest``.
    """
    lora: dict[str, Any] = {}
    if adapters:
        lora = {
            "enable_lora": True,
            "max_loras": config.max_loras,
            "max_lora_rank": config.max_lora_rank,
            "lora_modules": [
                {"name": adapter_model(model, a.name), "path": a.path} for a in adapters
            ],
        }
    return {
        "model": config.model,
        "served_model_name": [model],
        "max_num_seqs": config.max_num_seqs,
        "block_size": config.block_size,
        "max_model_len": config.max_model_len,
        "dtype": config.dtype,
        "enforce_eager": config.enforce_eager,
        "enable_prefix_caching": config.enable_prefix_caching,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        # Usage carries cached_tokens, which metering and the routing experiments read.
        "enable_prompt_tokens_details": True,
        **({"runner": "pooling"} if task == "embed" else {}),
        **lora,
        **config.engine_args,
    }


def vllm_server_args(
    model: str,
    config: VLLMEngineConfig,
    task: Literal["generate", "embed"] = "generate",
    adapters: Sequence[AdapterConfig] = (),
) -> argparse.Namespace:
    """The arguments ``vllm serve`` would have parsed, from Forge's config.

    Starting from vLLM's own parser keeps every default (engine and OpenAI front end) exactly as
    ``vllm serve`` has it; only what ``vllm_settings`` names is changed.
    """
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser = import_first(
        "vllm.entrypoints.launchers.cli_args:make_arg_parser",  # vLLM >= 0.30
        "vllm.entrypoints.openai.cli_args:make_arg_parser",
    )
    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])
    unknown = sorted(name for name in config.engine_args if not hasattr(args, name))
    if unknown:
        raise ValueError(f"engine_args {unknown} are not vLLM engine or server arguments")
    for name, value in vllm_settings(model, config, task, adapters).items():
        if name == "lora_modules":  # what vLLM's parser makes of --lora-modules
            from vllm.entrypoints.openai.models.protocol import LoRAModulePath

            value = [LoRAModulePath(**module) for module in value]
        setattr(args, name, value)
    return args


def import_first(*paths: str):
    """The first of ``module:attribute`` that imports: vLLM moves modules between releases."""
    for path in paths:
        module_name, attribute = path.split(":")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {paths} is importable from the installed vLLM")
