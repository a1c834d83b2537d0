"""The gateway wired in one process, without Ray: real parts, in-process implementations.

Every seam gets its in-process implementation: the pools run real ``Replica`` objects and their
engines (``LocalPoolBackend``), each pool with admission gets its own ``FairScheduler``
(``LocalSchedulerClient``), the breakers live in a ``BreakerBoard`` in this process, and the
store is whatever the config says (embedded, or Redis). The fallback is real HTTP unless a
transport is given (an ASGI app, for tests). What this cannot show is what only Serve does: the
routing policies, autoscaling, several gateway replicas sharing one budget.

    python -m serve_app.local configs/local.yaml --port 8001

serves the ``forge`` application of a Serve config file with uvicorn (a profiler's view of the
gateway alone, or a laptop without Ray).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

import httpx
from opentelemetry.trace import Tracer

from serve_app.admission.client import LocalSchedulerClient, fair_scheduler
from serve_app.auth.keys import KeyRing
from serve_app.backends.base import Backend
from serve_app.backends.credentials import Credentials
from serve_app.backends.fallback import FallbackBackend
from serve_app.backends.local_pool import LocalPoolBackend
from serve_app.backends.pool import pool_timeouts
from serve_app.bridge import PoolBridge
from serve_app.config.live import serve_config_forge
from serve_app.config.models import ForgeConfig, PoolConfig
from serve_app.gateway.server import Gateway
from serve_app.metering.book import UsageBook
from serve_app.metrics import ForgeMetrics
from serve_app.replica.server import Replica
from serve_app.resilience.board import BreakerBoard
from serve_app.resilience.client import BreakerClient
from serve_app.resilience.settings import breaker_client_options, breaker_settings
from serve_app.stack import Collaborators
from serve_app.store import Store, build_stores
from serve_app.tracing import tracer_for


def build_local_gateway(
    config: ForgeConfig,
    *,
    store: Store | None = None,
    metrics: ForgeMetrics | None = None,
    fallback_transport: httpx.AsyncBaseTransport | None = None,
    fallback_credentials: Credentials | None = None,
    board: BreakerBoard | None = None,
    tracer: Tracer | None = None,
    book: UsageBook | None = None,
) -> Gateway:
    """A ``Gateway`` whose collaborators all live in this process (see the module docstring).

    ``board`` may be shared by several local gateways, as gateway replicas share the board
    deployment; ``store`` (budgets and settles, and the cache unless ``cache.store`` names a
    Redis of its own) and ``book`` (the usage ledger) override the config's; ``tracer`` (by
    default the config's, which exports only where OTEL_EXPORTER_OTLP_ENDPOINT is set) traces
    the gateway and its replicas.
    """
    tracer = tracer or tracer_for(config.tracing, "forge-gateway")
    metrics = metrics or ForgeMetrics()
    stores = build_stores(config, main=store, on_state=metrics.store_changed)
    board = board or BreakerBoard(breaker_settings(config.resilience.breaker))
    breakers = BreakerClient(
        board, config.resilience.sync_interval_s, **breaker_client_options(config.resilience)
    )
    backends: dict[str, Backend] = {}
    for pool in config.pools:
        bridge = PoolBridge(breakers=breakers)
        backends[pool.name] = LocalPoolBackend(
            pool.name, local_replicas(pool, tracer), pool_timeouts(pool), bridge
        )
    if config.fallback is not None:
        backends["fallback"] = FallbackBackend(
            config.fallback, transport=fallback_transport, credentials=fallback_credentials
        )
    schedulers = {
        pool.name: LocalSchedulerClient(
            fair_scheduler(pool.admission, config.tenants), pool.admission.deadline_s
        )
        for pool in config.pools
        if pool.admission is not None
    }
    parts = Collaborators(
        KeyRing.from_config(config),
        stores.main,
        metrics,
        backends,
        schedulers,
        breakers,
        tracer,
        stores.usage,  # a store handed in serves usage too
        book,
        stores.cache,
    )
    return Gateway(config, parts)


def local_replicas(pool: PoolConfig, tracer: Tracer | None = None) -> list[Replica]:
    """The pool's replicas in this process: ``deployment.num_replicas`` of them (at least 1)."""
    count = max(1, int(pool.deployment.get("num_replicas") or 1))
    replicas = []
    for i in range(count):
        replica = Replica(pool.model_dump())
        replica.replica_id = f"{pool.name}-{i}"
        replica.tracer = tracer
        replicas.append(replica)
    return replicas


def _forge_config(serve_config: Mapping, app: str) -> ForgeConfig:
    """The app's args with its gateway's user_config over them, as Serve would serve them, and
    its pools' own applications inlined (all in this one process)."""
    for application in serve_config.get("applications", []):
        if application.get("name") == app:
            env = (application.get("runtime_env") or {}).get("env_vars") or {}
            for name, value in env.items():
                os.environ.setdefault(name, str(value))
            return serve_config_forge(serve_config, app)
    raise SystemExit(f"no application named {app!r} in the config")


def main() -> None:
    import uvicorn
    import yaml

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a Ray Serve config file (configs/local.yaml)")
    parser.add_argument("--app", default="forge")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    with open(args.config) as f:
        config = _forge_config(yaml.safe_load(f), args.app)
    gateway = build_local_gateway(config)
    uvicorn.run(gateway.asgi_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
