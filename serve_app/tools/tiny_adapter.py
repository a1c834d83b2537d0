"""Write a tiny LoRA adapter for the tiny model (``tiny_model.py``), offline, in PEFT's format.

The real-vLLM adapter tests need an adapter vLLM loads and whose answers differ from the base
model's; nothing may be downloaded. This writes PEFT's two files, ``adapter_config.json`` and
``adapter_model.safetensors``: rank-``r`` A and B matrices for every attention and MLP
projection of the tiny model's two layers, drawn from a seeded generator and non-zero (PEFT
starts B at zero, which would change nothing), large enough to move the logits.

    python -m serve_app.tools.tiny_adapter PATH [--seed N] [--rank R]

Same seed, same files. Another seed makes another adapter (another "tenant's fine-tune").
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from serve_app.tools.tiny_model import SEED

# The tiny model's shapes (``tiny_model.build_model``): hidden 128, 2 heads of 64, 1 KV head.
HIDDEN, INTERMEDIATE, KV, LAYERS = 128, 256, 64, 2
# module → (in features, out features)
SHAPES = {
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV),
    "v_proj": (HIDDEN, KV),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTERMEDIATE),
    "up_proj": (HIDDEN, INTERMEDIATE),
    "down_proj": (INTERMEDIATE, HIDDEN),
}
_PREFIX = {"mlp": ("gate_proj", "up_proj", "down_proj")}


def adapter_config(rank: int, base_model: str = "forge-tiny") -> dict:
    """PEFT's ``LoraConfig`` as it saves it, for the modules in ``SHAPES``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(SHAPES),
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def build(path: str | Path, seed: int = SEED + 1, rank: int = 8, scale: float = 0.5) -> Path:
    """The adapter's two files in ``path`` (created if missing); ``scale``: the weights' std."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in SHAPES.items():
            block = "mlp" if module in _PREFIX["mlp"] else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{name}.lora_A.weight"] = scale * torch.randn(
                rank, fan_in, generator=generator
            )
            tensors[f"{name}.lora_B.weight"] = scale * torch.randn(
                fan_out, rank, generator=generator
            )
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(adapter_config(rank), indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="directory to write the adapter into (created if missing)")
    parser.add_argument("--seed", type=int, default=SEED + 1)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch a hub
    print(build(args.path, args.seed, args.rank))


if __name__ == "__main__":
    main()
