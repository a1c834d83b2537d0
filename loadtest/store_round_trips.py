"""Redis commands per request: what one metered request costs the budget store.

    python -m loadtest.store_round_trips [--redis-url redis://127.0.0.1:6379/0] [--check]

An in-process gateway (``serve_app/local.py``: real stages, the simulated engine, no Ray) with
one tenant that has a requests/min, a tokens/min and a stream cap, on Redis; ``--requests``
chat requests one after another, each one's settles drained before the next, in two workloads:
``exact`` (the answer uses all of ``max_tokens``: nothing to refund) and ``refund`` (the usual
request: a shorter answer than ``max_tokens``, so the end refunds the rest). Redis's own
``INFO commandstats`` (reset before each) says how many calls of each kind the store got, per
request (a script's own commands counted under their names), and ``client_round_trips`` what
the gateway's client sent: the reserve before admission, and at the end the settle (the refund
and the lease's release in one script) or a lone release (``zrem``) where nothing is refunded.
``--check`` exits 1 unless every request costs at most two client round trips: one before
admission, one at its end.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys

import httpx
import redis
from redis.asyncio import Redis

from serve_app.config.models import load_config
from serve_app.local import build_local_gateway

KEY = "sk-round-trips-local-only"
ANSWER_TOKENS = 4
WORKLOADS = {"exact": ANSWER_TOKENS, "refund": 4 * ANSWER_TOKENS}  # → max_tokens


def forge_args(redis_url: str) -> dict:
    return {
        "tenants": [
            {
                "name": "round-trips",
                "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()],
                "limits": {"rpm": 10**7, "tpm": 10**9, "max_concurrent_streams": 10**4},
            }
        ],
        # Every answer ANSWER_TOKENS long: the workloads differ by max_tokens alone.
        "pools": [
            {
                "name": "primary",
                "model": "forge-sim",
                "engine": {"output_tokens_min": ANSWER_TOKENS, "output_tokens_max": ANSWER_TOKENS},
            }
        ],
        "store": {"redis_url": redis_url, "key_prefix": "forge-round-trips:"},
        "cache": {"enabled": False},
        "metering": {"enabled": False},
    }


async def measure(redis_url: str, requests: int) -> dict[str, dict[str, float]]:
    gateway = build_local_gateway(load_config(forge_args(redis_url)))
    server = redis.Redis.from_url(redis_url)
    headers = {"authorization": f"Bearer {KEY}"}
    transport = httpx.ASGITransport(gateway.asgi_app())
    per_workload = {}
    sent = CountedCalls()
    async with gateway.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        for workload, max_tokens in WORKLOADS.items():
            body = {
                "model": "forge-sim",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens,
            }
            await c.post("/v1/chat/completions", json=body, headers=headers)  # scripts loaded
            await gateway.lasting.settles.drain()
            server.config_resetstat()
            sent.calls = 0
            for _ in range(requests):
                response = await c.post("/v1/chat/completions", json=body, headers=headers)
                response.raise_for_status()
                await gateway.lasting.settles.drain()
            stats = server.info("commandstats")
            calls = {name.removeprefix("cmdstat_"): row["calls"] for name, row in stats.items()}
            for ours in ("config|resetstat", "info"):
                calls.pop(ours, None)
            per_workload[workload] = {name: calls[name] / requests for name in sorted(calls)}
            per_workload[workload]["client_round_trips"] = sent.calls / requests
    return per_workload


class CountedCalls:
    """Every command the gateway's redis-py client sends (one round trip each), counted where
    it leaves: ``commandstats`` counts a script's own commands under their names too."""

    def __init__(self) -> None:
        self.calls = 0
        self._send = Redis.execute_command

        async def counted(client, *args, **options):
            self.calls += 1
            return await self._send(client, *args, **options)

        Redis.execute_command = counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    per_workload = asyncio.run(measure(args.redis_url, args.requests))
    print(json.dumps(per_workload, indent=1))
    failed = False
    for workload, per_request in per_workload.items():
        trips = per_request["client_round_trips"]
        print(f"{workload}: {trips:.2f} client round trips per request")
        if args.check and trips > 2.0:
            print(f"FAILED {workload}: {trips:.2f} round trips per request, want 2 at most")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
