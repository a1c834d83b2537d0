"""The routing experiment: which policy keeps shared prefixes hot, and at what load balance.

    python -m loadtest.routing [--duration 20] [--out loadtest/results/routing.json]

Simulated replicas whose prefill costs 0.2 ms per uncached prompt token (a 1.5k-token system
prompt: ~300 ms cold, ~0 hot), chunked at vLLM's default budget of 2,048 tokens a step, and
whose prefix cache holds about 10 system prompts each. Main workload (4 replicas): 80 % of
requests start with one of 20 system prompts (1–2k tokens), 20 % are unique. Skewed (4
replicas): one system prompt takes 50 % of all traffic. Pressure (8 replicas): 200 system
prompts, about twice what the 8 caches hold together, so replicas evict all the time and the
routers' indexes must follow. Adapters (4 replicas, 4 LoRA slots each, a load costing
``ADAPTER_LOAD_S``): 20 tenants' adapters over the one model, their popularity Zipf-like (the
i-th most called 1/i as often), each with its tenant's short system prompt 80 % of the time; round
robin against adapter-aware routing (``routing/adapters.py``; a policy name with ``+adapters``
has it on, without it off), compared on TTFT and adapter loads per minute. Closed loop, 16
clients, through the gateway (direct ingress).
Every policy gets a fresh application (cold caches). The oracle is the best hit rate the
request sequence allows with unbounded caches: every shared prompt misses once, then always
hits its full blocks; unique prompts never hit.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import time
from pathlib import Path

import httpx

from loadtest import plots
from loadtest.http_load import closed_loop
from loadtest.inprocess import start_forge, stop_forge, without_ingress_drain
from serve_app import tokenizer

POLICIES = ["round_robin", "least_in_flight", "least_queue", "prefix_affinity", "kv_aware"]
# The adapter workload's: with "+adapters", adapter affinity on.
ADAPTER_POLICIES = [
    "round_robin",
    "least_in_flight",
    "round_robin+adapters",
    "least_in_flight+adapters",
]
ADAPTERS = [f"tenant-{i:02d}" for i in range(20)]
ADAPTER_SLOTS = 4
# Loading an adapter into a slot: ~50 ms, the order of a rank-16 adapter of a 3B model read
# from the host's memory onto the GPU (vLLM's CPU cache); from disk it is more.
ADAPTER_LOAD_S = 0.05
# Fine-tunes' prompts are short (their task is in the weights): 100-300 system tokens, so
# prefill is ~20-60 ms and an adapter's load and slot are what routing can save.
ADAPTER_SYSTEM_TOKENS = (100, 300)
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
    "max_num_batched_tokens": 2048,
}
# workload → (replicas, system prompts, share of the hottest prompt or None)
WORKLOADS = {
    "main": (4, 20, None),
    "skewed": (4, 20, 0.5),
    "pressure": (8, 200, None),
    "adapters": (4, len(ADAPTERS), None),
}
WORDS = tokenizer.OUTPUT_WORDS


def _text(rng: random.Random, tokens: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(tokens)).strip()


class Workload:
    """A seeded request mix; also counts what an oracle cache could have hit."""

    def __init__(
        self,
        system_prompts: int,
        hot_share: float | None,
        seed: int = 7,
        adapters: list[str] | None = None,
        system_tokens: tuple[int, int] = (1000, 2000),
    ) -> None:
        self.rng = random.Random(seed)
        # With adapters, the i-th shared prompt is the i-th adapter's tenant's, called 1/i as
        # often as the first (and a unique prompt goes to an adapter drawn alike).
        self.adapters = adapters
        self.weights = [1 / (i + 1) for i in range(len(adapters or ()))]
        prompts_rng = random.Random(1)
        self.unique_tokens = system_tokens[0] // 2  # a one-off prompt's system turn
        self.system = [
            _text(prompts_rng, prompts_rng.randint(*system_tokens)) for _ in range(system_prompts)
        ]
        self.hot_share = hot_share
        self.seen: set[int] = set()
        self.prompt_tokens = 0
        self.oracle_hits = 0
        self.n = 0

    def __call__(self) -> dict:
        rng = self.rng
        self.n += 1
        user = {"role": "user", "content": f"question {self.n}: " + _text(rng, 20)}
        adapter = None
        if self.adapters:
            (adapter,) = rng.choices(range(len(self.adapters)), self.weights)
        if self.hot_share is not None and rng.random() < self.hot_share:
            shared = 0
        elif adapter is not None:
            shared = adapter if rng.random() < 0.8 else None
        elif rng.random() < 0.8:
            shared = rng.randrange(len(self.system))
        else:
            shared = None
        if shared is None:
            messages = [{"role": "system", "content": _text(rng, self.unique_tokens)}, user]
        else:
            messages = [{"role": "system", "content": self.system[shared]}, user]
        self._account(messages, shared)
        model = "forge-sim" if adapter is None else f"forge-sim:{self.adapters[adapter]}"
        return {"model": model, "messages": messages, "max_tokens": 16, "stream": True}

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


def forge_args(
    policy: str, replicas: int = 4, options: dict | None = None, adapters: bool = False
) -> dict:
    """``policy`` may end in ``+adapters``: adapter affinity on (only then, for this experiment's
    comparison; a pool's default has it on)."""
    policy, _, layer = policy.partition("+")
    pool: dict = {
        "name": "primary",
        "model": "forge-sim",
        "engine": ENGINE,
        "routing": {
            "policy": policy,
            "stats_period_s": 0.5,
            "options": options or {},
            "adapter_affinity": layer == "adapters",
        },
        "deployment": {"num_replicas": replicas, "ray_actor_options": {"num_cpus": 0}},
    }
    if adapters:
        pool["engine"] = {**ENGINE, "max_loras": ADAPTER_SLOTS, "adapter_load_s": ADAPTER_LOAD_S}
        pool["adapters"] = [{"name": a, "path": f"/weights/adapters/{a}"} for a in ADAPTERS]
    return {
        "tenants": [{"name": "bench", "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()]}],
        "pools": [pool],
    }


async def run_policy(
    policy: str, workload_name: str, duration: float, options: dict | None = None
) -> dict:
    from ray import serve

    from loadtest import inprocess
    from serve_app.replica import admin as replica_admin

    replicas, system_prompts, hot_share = WORKLOADS[workload_name]
    adapters = workload_name == "adapters"
    url = start_forge(forge_args(policy, replicas, options, adapters), reuse=True)
    workload = (
        Workload(system_prompts, hot_share, adapters=ADAPTERS, system_tokens=ADAPTER_SYSTEM_TOKENS)
        if adapters
        else Workload(system_prompts, hot_share)
    )
    before = {s["replica"]: s for s in replica_admin.all_stats("forge", "pool-primary")}
    index_before = _index_metrics(inprocess.metrics_port)
    started = time.perf_counter()
    run = await closed_loop(
        f"{url}/v1/chat/completions", workload, concurrency=16, duration_s=duration, api_key=KEY
    )
    wall = time.perf_counter() - started
    after = replica_admin.all_stats("forge", "pool-primary")
    await asyncio.sleep(2.5)  # Ray's metrics agent reports each second: let the last batch land
    index = _index_delta(index_before, _index_metrics(inprocess.metrics_port))
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
    loads = sum(s.get("lora_loads", 0) for s in after) - sum(
        s.get("lora_loads", 0) for s in before.values()
    )
    adapter_rows = {"adapter_loads_per_min": loads / wall * 60} if adapters else {}
    return {
        "policy": policy,
        "workload": workload_name,
        "replicas": replicas,
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
        **adapter_rows,
        **index,
    }


_LAG = "ray_forge_kv_event_lag_seconds"


def _index_metrics(port: int | None) -> dict[str, float]:
    """The KV index's series (lag buckets, events, resyncs) summed over every process."""
    if port is None:
        return {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(("ray_forge_kv_", "ray_forge_kv_event_lag")):
            continue
        name, _, value = line.rpartition(" ")
        key = name.split("{", 1)[0]
        if key == f"{_LAG}_bucket":
            key += "|" + name.split('le="', 1)[1].split('"', 1)[0]
        elif key == "ray_forge_kv_index_blocks":
            key += "|" + name.split('target="', 1)[1].split('"', 1)[0]
        totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def _index_delta(before: dict[str, float], after: dict[str, float]) -> dict:
    """Lag quantiles (bucket upper bounds), events, resyncs and the largest index, this run."""
    if not after:
        return {}
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    buckets = sorted(
        (float(k.split("|")[1]), v) for k, v in delta.items() if k.startswith(f"{_LAG}_bucket|")
    )
    count = delta.get(f"{_LAG}_count", 0.0)

    def quantile(q: float) -> float | None:
        for bound, cumulative in buckets:
            if count and cumulative >= q * count:
                return bound * 1000
        return None

    blocks = [v for k, v in after.items() if k.startswith("ray_forge_kv_index_blocks|")]
    return {
        "kv_events": int(delta.get("ray_forge_kv_events_total", 0)),
        "kv_resyncs": int(delta.get("ray_forge_kv_resyncs_total", 0)),
        "kv_lag_p50_ms_le": quantile(0.5),
        "kv_lag_p99_ms_le": quantile(0.99),
        "kv_index_max_blocks": int(max(blocks)) if blocks else None,
    }


def plot(rows: list[dict], path: Path) -> None:
    shown = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    fig, axes = plots.subplots(1, len(shown), figsize=(4 * len(shown) + 1, 4), squeeze=False)
    for ax, workload in zip(axes[0], shown, strict=True):
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
    parser.add_argument("--adapter-policies", nargs="+", default=ADAPTER_POLICIES)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument(
        "--kv-options", type=json.loads, default={}, help="kv_aware's options, as JSON"
    )
    parser.add_argument("--out", default="loadtest/results/routing.json")
    parser.add_argument("--plot", default="docs/img/routing.png")
    args = parser.parse_args()
    without_ingress_drain()  # each policy's graph is deleted before the next one's
    rows = []
    try:
        for workload in args.workloads:
            policies = args.adapter_policies if workload == "adapters" else args.policies
            for policy in policies:
                options = args.kv_options if policy == "kv_aware" else None
                rows.append(asyncio.run(run_policy(policy, workload, args.duration, options)))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        stop_forge()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"engine": ENGINE, "rows": rows}, indent=1))
    plot(rows, Path(args.plot))


if __name__ == "__main__":
    main()
