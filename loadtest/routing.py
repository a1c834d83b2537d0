"""The routing experiment: which policy keeps shared prefixes hot, and at what load balance.

    python -m loadtest.routing [--duration 20] [--out loadtest/results/routing.json]

4 simulated replicas whose prefill costs 0.2 ms per uncached prompt token (a 1.5k-token system
prompt: ~300 ms cold, ~0 hot) and whose prefix cache holds about half of the 20 system prompts.
Main workload: 80 % of requests start with one of 20 system prompts (1–2k tokens), 20 % are
unique. Skewed workload: one system prompt takes 50 % of all traffic. Closed loop, 16 clients,
through the gateway (direct ingress). Every policy gets a fresh application (cold caches).
The oracle row is the best hit rate the request sequence allows: every shared prompt misses once,
then always hits its full blocks; unique prompts never hit.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import time
from pathlib import Path

from loadtest import plots
from loadtest.http_load import closed_loop
from loadtest.inprocess import start_forge, stop_forge
from serve_app import tokenizer

POLICIES = ["round_robin", "least_in_flight", "least_queue", "prefix_affinity", "kv_aware"]
KEY = "sk-routing-bench"
BLOCK = 16
ENGINE = {
    "max_num_seqs": 8,
    "block_size": BLOCK,
    "num_kv_blocks": 1100,  # ~10 of the 20 system prompts (plus running requests)
    "prefill_base_s": 0.01,
    "prefill_per_token_s": 0.0002,
    "decode_base_s": 0.01,
    "decode_per_seq_s": 0.0005,
}
WORDS = tokenizer.OUTPUT_WORDS


def _text(rng: random.Random, tokens: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(tokens)).strip()


class Workload:
    """A seeded request mix; also counts what an oracle cache could have hit."""

    def __init__(self, skewed: bool, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        prompts_rng = random.Random(1)
        self.system = [_text(prompts_rng, prompts_rng.randint(1000, 2000)) for _ in range(20)]
        self.skewed = skewed
        self.seen: set[int] = set()
        self.prompt_tokens = 0
        self.oracle_hits = 0
        self.n = 0

    def __call__(self) -> dict:
        rng = self.rng
        self.n += 1
        user = {"role": "user", "content": f"question {self.n}: " + _text(rng, 20)}
        if self.skewed and rng.random() < 0.5:
            shared = 0
        elif rng.random() < 0.8:
            shared = rng.randrange(len(self.system))
        else:
            shared = None
        if shared is None:
            messages = [{"role": "system", "content": _text(rng, 500)}, user]
        else:
            messages = [{"role": "system", "content": self.system[shared]}, user]
        self._account(messages, shared)
        return {"model": "forge-sim", "messages": messages, "max_tokens": 16, "stream": True}

    def _account(self, messages: list[dict], shared: int | None) -> None:
        tokens = tokenizer.count_tokens(tokenizer.render_chat(messages))
        self.prompt_tokens += tokens
        if shared is None:
            return
        if shared in self.seen:
            system_only = tokenizer.count_tokens(tokenizer.render_chat(messages[:1]))
            self.oracle_hits += (system_only // BLOCK) * BLOCK
        self.seen.add(shared)

    @property
    def oracle_hit_rate(self) -> float:
        return self.oracle_hits / max(1, self.prompt_tokens)


def forge_args(policy: str) -> dict:
    return {
        "tenants": [{"name": "bench", "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()]}],
        "pools": [
            {
                "name": "primary",
                "model": "forge-sim",
                "engine": ENGINE,
                "routing": {"policy": policy, "stats_period_s": 0.5},
                "deployment": {"num_replicas": 4, "ray_actor_options": {"num_cpus": 0}},
            }
        ],
    }


async def run_policy(policy: str, skewed: bool, duration: float) -> dict:
    from ray import serve

    from serve_app import replica_admin

    url = start_forge(forge_args(policy), reuse=True)
    workload = Workload(skewed)
    before = {s["replica"]: s for s in replica_admin.all_stats("forge", "pool-primary")}
    started = time.perf_counter()
    run = await closed_loop(
        f"{url}/v1/chat/completions", workload, concurrency=16, duration_s=duration, api_key=KEY
    )
    wall = time.perf_counter() - started
    after = replica_admin.all_stats("forge", "pool-primary")
    serve.delete("forge")
    queries = {
        s["replica"]: s["prefix_cache_queries"]
        - before.get(s["replica"], {}).get("prefix_cache_queries", 0)
        for s in after
    }
    hits = sum(s["prefix_cache_hits"] for s in after) - sum(
        s["prefix_cache_hits"] for s in before.values()
    )
    load = list(queries.values())
    summary = run.summary()
    return {
        "policy": policy,
        "workload": "skewed" if skewed else "main",
        "requests": summary["ok"],
        "errors": summary["errors"],
        "req_per_s": summary["ok"] / wall,
        "ttft_p50_ms": summary["ttft_p50_ms"],
        "ttft_p95_ms": summary["ttft_p95_ms"],
        "total_p50_ms": summary["total_p50_ms"],
        "total_p95_ms": summary["total_p95_ms"],
        "hit_rate": hits / max(1, sum(load)),
        "oracle_hit_rate": workload.oracle_hit_rate,
        "max_over_mean_load": max(load) / (sum(load) / len(load)) if sum(load) else float("nan"),
    }


def plot(rows: list[dict], path: Path) -> None:
    fig, axes = plots.subplots(1, 2, figsize=(11, 4))
    for ax, workload in zip(axes, ("main", "skewed"), strict=True):
        sub = [r for r in rows if r["workload"] == workload]
        names = [r["policy"] for r in sub]
        ax.bar(names, [r["ttft_p50_ms"] for r in sub], color="tab:blue", label="TTFT p50 (ms)")
        ax.set_ylabel("TTFT p50 (ms)")
        twin = ax.twinx()
        twin.plot(
            names,
            [100 * r["hit_rate"] for r in sub],
            "o-",
            color="tab:orange",
            label="prefix-cache hit rate (%)",
        )
        oracle = 100 * sub[0]["oracle_hit_rate"] if sub else 0
        twin.axhline(oracle, color="grey", linestyle="--", label="oracle hit rate")
        twin.set_ylim(0, 100)
        twin.set_ylabel("hit rate (%)")
        ax.set_title(f"{workload} workload")
        ax.tick_params(axis="x", rotation=30)
        twin.legend(loc="upper right", fontsize=8)
    plots.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=20)
    parser.add_argument("--policies", nargs="+", default=POLICIES)
    parser.add_argument("--out", default="loadtest/results/routing.json")
    parser.add_argument("--plot", default="docs/img/routing.png")
    args = parser.parse_args()
    rows = []
    try:
        for skewed in (False, True):
            for policy in args.policies:
                rows.append(asyncio.run(run_policy(policy, skewed, args.duration)))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_forge()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"engine": ENGINE, "rows": rows}, indent=1))
    plot(rows, Path(args.plot))


if __name__ == "__main__":
    main()
