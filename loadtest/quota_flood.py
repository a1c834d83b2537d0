"""One tenant floods past its tokens/min budget while another runs normally.

    python -m loadtest.quota_flood [--duration 15] [--redis-url redis://127.0.0.1:6379/0]

Reports the noisy tenant's 429 rate, the steady tenant's latency beside its solo baseline, and
the store round trips per request (Redis ``INFO commandstats`` before and after). The noisy
tenant retries 50 ms after a 429, hotter than any SDK, to show refusals stay cheap.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
from pathlib import Path

from loadtest.http_load import closed_loop
from loadtest.inprocess import start_forge, stop_forge

ENGINE = {
    "prefill_base_s": 0.02,
    "prefill_per_token_s": 0.0001,
    "decode_base_s": 0.01,
    "decode_per_seq_s": 0.0001,
    "max_num_seqs": 32,
}
BODY = {
    "model": "forge-sim",
    "messages": [{"role": "user", "content": "a short answer please"}],
    "max_tokens": 32,
    "stream": True,
}
TENANTS = {
    "noisy": {"workers": 16, "limits": {"tpm": 3000}},
    "steady": {"workers": 2, "limits": {"tpm": 1_000_000}},
}
PREFIX = "forge-bench-quota:"


def key(tenant: str) -> str:
    return f"sk-quota-{tenant}"


def forge_args(redis_url: str) -> dict:
    return {
        "store": {"redis_url": redis_url, "key_prefix": PREFIX},
        "tenants": [
            {
                "name": t,
                "key_hashes": [hashlib.sha256(key(t).encode()).hexdigest()],
                "limits": spec["limits"],
            }
            for t, spec in TENANTS.items()
        ],
        "pools": [
            {
                "name": "primary",
                "model": "forge-sim",
                "engine": ENGINE,
                "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
            }
        ],
    }


# Commands the store sends itself; commandstats also counts those its Lua scripts run inside.
_CLIENT_COMMANDS = ("evalsha", "eval", "zrem", "get", "set", "hgetall")


def redis_calls(redis_url: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    stats = client.info("commandstats")
    client.close()
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in _CLIENT_COMMANDS)


def cleanup(redis_url: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    for k in client.scan_iter(f"{PREFIX}*"):
        client.delete(k)
    client.close()


async def drill(url: str, duration: float, redis_url: str) -> dict:
    endpoint = f"{url}/v1/chat/completions"

    def run(tenant: str, seconds: float):
        return closed_loop(
            endpoint,
            BODY,
            concurrency=TENANTS[tenant]["workers"],
            duration_s=seconds,
            api_key=key(tenant),
            pause_after_refusal_s=0.05,
        )

    solo = (await run("steady", duration / 2)).summary()
    calls_before = redis_calls(redis_url)
    noisy, steady = await asyncio.gather(run("noisy", duration), run("steady", duration))
    calls = redis_calls(redis_url) - calls_before
    handled = len(noisy.samples) + len(steady.samples)
    refused = sum(1 for s in noisy.samples if s.status == 429)
    return {
        "steady_solo": {k: round(solo[k], 1) for k in ("ok", "total_p50_ms", "total_p95_ms")},
        "steady_with_flood": {
            k: round(v, 1)
            for k, v in steady.summary().items()
            if k in ("ok", "errors", "total_p50_ms", "total_p95_ms")
        },
        "noisy": {
            "requests": len(noisy.samples),
            "served": len(noisy.ok()),
            "refused_429": refused,
            "refusal_rate": round(refused / max(1, len(noisy.samples)), 3),
        },
        "store_round_trips_per_request": round(calls / max(1, handled), 2),
        "store_round_trips_per_served_request": round(
            (calls - refused) / max(1, handled - refused), 2
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=15)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", default="loadtest/results/quota_flood.json")
    args = parser.parse_args()
    cleanup(args.redis_url)
    url = start_forge(forge_args(args.redis_url))
    try:
        result = asyncio.run(drill(url, args.duration, args.redis_url))
    finally:
        stop_forge()
        cleanup(args.redis_url)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
