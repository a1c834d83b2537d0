"""Run Forge in this process for a benchmark: ``python -m loadtest.serve_forge --port N ...``.

Prints one line ``READY <proxy-url> <direct-ingress-url or ->`` when it serves, then serves until
killed. Started by the benchmarks (pinned with taskset), never by the tests.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Serve holds a stopping ingress replica open 30 s under direct ingress so that a load balancer
# in front can deregister it first. A benchmark stops this Forge when its numbers are in, with
# nobody left to send it a request: without this, every stop waited out those 30 s
# (``inprocess.without_ingress_drain`` says the same for the in-process drills).
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")
# Serve's first HTTP proxy gets 60 s to start, not 5 (``loadtest/inprocess.py`` says why).
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")

BENCH_KEY = "sk-bench-local-only"


PIPELINES = ("full", "unmetered", "quota", "bare")


def forge_args(
    engine: dict,
    replicas: int,
    redis_url: str | None,
    pipeline: str = "full",
    max_streams: int | None = None,
) -> dict:
    """``full``: every stage on, with a metered tenant (budgets too large to bite) and fair
    admission; ``unmetered``: all that but the usage records and the response cache (the
    pipeline before them); ``quota``: no admission; ``bare``: no budgets and no admission
    either. ``max_streams``: room for that many open streams at every limit on the way (the
    gateway's and the pool's ``max_ongoing_requests``, admission, the tenant's stream cap;
    ``loadtest/concurrency.py`` says why each)."""
    room = max(max_streams or 0, 4096)
    limits = {"rpm": 10**7, "tpm": 10**9, "max_concurrent_streams": max(room, 10**4)}
    admission = {"max_inflight": room, "queue_cap": room}
    usage = pipeline not in ("unmetered", "bare")
    gateway: dict = {"ray_actor_options": {"num_cpus": 0}}
    pool: dict = {"num_replicas": replicas, "ray_actor_options": {"num_cpus": 0}}
    if max_streams:
        gateway["max_ongoing_requests"] = pool["max_ongoing_requests"] = room + 64
    return {
        "gateway": {"deployment": gateway},
        "cache": {"enabled": usage},
        "metering": {"enabled": usage},
        "store": {"redis_url": redis_url, "key_prefix": "forge-bench:"},
        "tenants": [
            {
                "name": "bench",
                "key_hashes": [hashlib.sha256(BENCH_KEY.encode()).hexdigest()],
                "limits": limits if pipeline != "bare" else {},
            }
        ],
        "pools": [
            {
                "name": "primary",
                "model": "forge-sim",
                "engine": engine,
                "admission": admission if pipeline in ("full", "unmetered") else None,
                "deployment": pool,
            }
        ],
    }


def main() -> None:
    import orjson

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", default="{}")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--redis-url", default=None, help="the store; embedded without one")
    parser.add_argument("--pipeline", choices=PIPELINES, default="full")
    parser.add_argument("--max-streams", type=int, default=None, help="room for this many")
    args = parser.parse_args()

    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.replica import admin as replica_admin

    ray.init(num_cpus=1, object_store_memory=100 * 1024 * 1024, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    engine = orjson.loads(args.engine)
    app = build_app(
        forge_args(engine, args.replicas, args.redis_url, args.pipeline, args.max_streams)
    )
    serve.run(app, name="forge", route_prefix="/")
    time.sleep(2)  # let the proxy learn the routes
    direct = replica_admin.direct_ingress_url("forge") or "-"
    print(f"READY http://127.0.0.1:{args.port} {direct}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    serve.shutdown()
    ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
