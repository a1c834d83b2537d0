"""What naming a request's blocks costs the router, per request: the simulator's way and vLLM's.

    python -m loadtest.prompt_hashing [--model DIR] [--requests 3000] [--out FILE]

Needs ``tokenizers`` (the vLLM virtualenv has it, and the tiny model: ``serve_app.tools.
tiny_model``; ``--model`` defaults to ``$FORGE_TINY_MODEL``). The requests are the routing
experiment's main workload (``loadtest/routing.py``: 20 shared system prompts of 1-2k words
80 % of the time, a one-off one otherwise, and a short question), hashed in process, one after
another, by each way a router can:

- ``simulated``: the simulated engine's tokenizer and chain (``SimulatedPromptHasher``);
- ``vllm-uncached``: the model's chat template and tokenizer, vLLM's block hashes, every
  request tokenized whole (``VllmPromptHasher`` with no segment cache);
- ``vllm``: the same with the segment cache (a system prompt is tokenized once).

Each request's wall time is split into its tokenization and the rest (the block hashes), at
vLLM's GPU block size of 16 and the router's default of 128 blocks. One process, one core;
the first request of each system prompt pays the cache's miss and is counted like any other.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from loadtest.routing import Workload
from serve_app.routing.prompt_hashing import SimulatedPromptHasher, VllmPromptHasher

BLOCK_SIZE = 16
ROUTE_BLOCKS = 128


def _summary(micros: list[float]) -> dict:
    ordered = sorted(micros)
    return {
        "mean_us": round(statistics.fmean(ordered), 1),
        "p50_us": round(ordered[len(ordered) // 2], 1),
        "p99_us": round(ordered[int(len(ordered) * 0.99)], 1),
    }


def measure(name: str, hasher, bodies: list[dict]) -> dict:
    totals, tokenizing, tokens, blocks = [], [], [], []
    for body in bodies:
        start = time.perf_counter()
        if isinstance(hasher, VllmPromptHasher):
            ids, _ = hasher.token_ids(body, "chat")
            tokenized = time.perf_counter()
            hashes = hasher.hasher.block_hashes(ids[: BLOCK_SIZE * ROUTE_BLOCKS], BLOCK_SIZE)
        else:
            tokenized = None
            route = hasher.route(body, "chat")
            ids, hashes = range(route.prompt_tokens), route.block_hashes
        end = time.perf_counter()
        totals.append((end - start) * 1e6)
        if tokenized is not None:
            tokenizing.append((tokenized - start) * 1e6)
        tokens.append(len(ids))
        blocks.append(len(hashes))
    result = {
        "hasher": name,
        "requests": len(bodies),
        "prompt_tokens_mean": round(statistics.fmean(tokens)),
        "blocks_hashed_mean": round(statistics.fmean(blocks), 1),
        "total": _summary(totals),
    }
    if tokenizing:
        result["tokenize"] = _summary(tokenizing)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.environ.get("FORGE_TINY_MODEL"))
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--out", default="loadtest/results/prompt-hashing.json")
    args = parser.parse_args()
    if not args.model:
        parser.error("--model (or FORGE_TINY_MODEL): a model directory with tokenizer.json")
    workload = Workload(system_prompts=20, hot_share=None)
    bodies = [workload() for _ in range(args.requests)]

    def vllm(segment_cache: int) -> VllmPromptHasher:
        return VllmPromptHasher(
            args.model, "forge-tiny", BLOCK_SIZE, ROUTE_BLOCKS, segment_cache=segment_cache
        )

    results = [
        measure("simulated", SimulatedPromptHasher(BLOCK_SIZE, ROUTE_BLOCKS), bodies),
        measure("vllm-uncached", vllm(0), bodies),
        measure("vllm", vllm(1024), bodies),
    ]
    report = {
        "command": "python -m loadtest.prompt_hashing",
        "model": Path(args.model).name,
        "block_size": BLOCK_SIZE,
        "route_blocks": ROUTE_BLOCKS,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}",
        "results": results,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for r in results:
        tok = r.get("tokenize", {})
        print(
            f"{r['hasher']:14} tokens {r['prompt_tokens_mean']:5}"
            f" blocks {r['blocks_hashed_mean']:6}"
            f"  total mean {r['total']['mean_us']:8} p50 {r['total']['p50_us']:8}"
            f" p99 {r['total']['p99_us']:8} us   tokenize mean {tok.get('mean_us', '-')}"
            f" p50 {tok.get('p50_us', '-')}"
        )


if __name__ == "__main__":
    main()
