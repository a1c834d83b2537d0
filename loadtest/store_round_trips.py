"""Redis commands per request: what one metered request costs the budget store.

    python -m loadtest.store_round_trips [--redis-url redis://127.0.0.1:6379/0] [--check]

An in-process gateway (``serve_app/local.py``: real stages, the simulated engine, no Ray) with
one tenant that has a requests/min, a tokens/min and a stream cap, on Redis; ``--requests``
chat requests one after another, each one's settles drained before the next. Redis's own
``INFO commandstats`` (reset before the run) says how many calls of each kind the store got,
per request: ``evalsha`` is a script round trip (the reserve before admission, a settle that
adjusts), ``zrem`` the lease's release. ``--check`` exits 1 unless the reserve is one round
trip (one ``evalsha`` per request whose usage matched its reservation).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys

import httpx
import redis

from serve_app.config.models import load_config
from serve_app.local import build_local_gateway

KEY = "sk-round-trips-local-only"
BODY = {"model": "forge-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def forge_args(redis_url: str) -> dict:
    return {
        "tenants": [
            {
                "name": "round-trips",
                "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()],
                "limits": {"rpm": 10**7, "tpm": 10**9, "max_concurrent_streams": 10**4},
            }
        ],
        # Exactly max_tokens out: usage equals the reservation, so no settle adjusts.
        "pools": [{"name": "primary", "model": "forge-sim", "engine": {"output_tokens_min": 4}}],
        "store": {"redis_url": redis_url, "key_prefix": "forge-round-trips:"},
        "cache": {"enabled": False},
        "metering": {"enabled": False},
    }


async def measure(redis_url: str, requests: int) -> dict[str, float]:
    gateway = build_local_gateway(load_config(forge_args(redis_url)))
    server = redis.Redis.from_url(redis_url)
    headers = {"authorization": f"Bearer {KEY}"}
    transport = httpx.ASGITransport(gateway.asgi_app())
    async with gateway.lifespan(), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        await c.post("/v1/chat/completions", json=BODY, headers=headers)  # scripts loaded
        await gateway.lasting.settles.drain()
        server.config_resetstat()
        for _ in range(requests):
            response = await c.post("/v1/chat/completions", json=BODY, headers=headers)
            response.raise_for_status()
            await gateway.lasting.settles.drain()
        stats = server.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): row["calls"] for name, row in stats.items()}
    for ours in ("config|resetstat", "info"):
        calls.pop(ours, None)
    return {name: calls[name] / requests for name in sorted(calls)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    per_request = asyncio.run(measure(args.redis_url, args.requests))
    print(json.dumps(per_request, indent=1))
    print(f"{sum(per_request.values()):.2f} Redis commands per request (scripts count their own)")
    if args.check and per_request.get("evalsha", 0) > 1.0:
        print(f"FAILED {per_request['evalsha']} script round trips per request, want 1")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
