"""App builders: the ``import_path`` targets of Forge's Ray Serve config files.

``build_app`` validates the config's ``args`` and wires the graph with handles: one replica
deployment per pool that runs in this application, a scheduler per admitted pool, the breaker
board, and the gateway ingress that holds their handles and the fallback client. A pool with
``app`` set runs in an application of its own, built by ``build_pool``; with ``control_app``
set, the schedulers and the board run in one of their own, built by ``build_control``; the
gateway finds them there by name. ``serve run configs/local.yaml`` and a KubeRay
``RayService`` both go through here.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from serve_app.admission.deployment import SchedulerDeployment, scheduler_deployment_name
from serve_app.bridge import pool_deployment_name
from serve_app.config.models import (
    PoolConfig,
    TracingConfig,
    load_config,
    load_control_app_config,
    load_pool_app_config,
)
from serve_app.gateway.ingress import GatewayIngress
from serve_app.replica.autoscaling import with_pool_policy
from serve_app.replica.pool_ingress import PoolApplication
from serve_app.replica.server import Replica
from serve_app.resilience.board import BOARD_DEPLOYMENT, BreakerBoardDeployment
from serve_app.resilience.settings import breaker_settings
from serve_app.routing.prompt_hashing import for_pool as prompt_hashing_for


def build_app(args: dict[str, Any]) -> Application:
    config = load_config(args)
    pools = {
        pool.name: _pool_deployment(pool, config.tracing)
        for pool in config.pools
        if pool.app is None  # the others run in their own applications (build_pool)
    }
    schedulers: dict[str, Application] = {}
    board = None  # both in the control application (build_control), found there by name
    if config.control_app is None:
        tenants = [t.model_dump() for t in config.tenants]
        schedulers = {
            pool.name: _scheduler(pool.name, pool.admission.model_dump(), tenants)
            for pool in config.pools
            if pool.admission is not None
        }
        board = _board(asdict(breaker_settings(config.resilience.breaker)))
    # The gateway mostly waits on backends: Serve's default of 5 ongoing requests per replica
    # would queue streams at the proxy long before its CPU is busy. It relays streams, so it
    # drains as long as the pools do.
    gateway_options = {
        "max_ongoing_requests": 1024,
        "graceful_shutdown_timeout_s": max(p.request_timeout_s for p in config.pools),
        **config.gateway.deployment,
    }
    gateway = serve.deployment(GatewayIngress).options(name="gateway", **gateway_options)
    # What the args set, not every default: a pool that runs in its own application must not
    # come back with an engine (PoolConfig refuses that; live changes revalidate this).
    return gateway.bind(config.model_dump(exclude_unset=True), pools, schedulers, board)


def build_control(args: dict[str, Any]) -> Application:
    """The pools' schedulers and the breaker board as an application of their own (args
    ``{schedulers: [pool, ...]}``): the gateway's application names it ``control_app``. They
    start with no settings and take the gateways' (``configure``), so a change to the gateway's
    args replaces the gateways and nothing here: the slot budgets, their leases and queues, and
    the open breakers carry on. Its ingress is the board (an application needs one; it has no
    route)."""
    config = load_control_app_config(args)
    return _board(None, *(_scheduler(pool) for pool in config.schedulers))


# The schedulers and the board answer the gateways' calls, one or more per request: Serve's
# access line for each was 15 % of a scheduler's busy CPU under the fairness flood (py-spy,
# docs/benchmarks.md "Cheap shedding"), and says nothing the gateway's own access line and the
# scheduler's metrics do not. Errors are still logged.
INTERNAL_LOGGING = {"enable_access_log": False}


def _scheduler(pool: str, admission: dict | None = None, tenants: list[dict] = ()) -> Application:
    return (
        serve.deployment(SchedulerDeployment)
        .options(
            name=scheduler_deployment_name(pool),
            num_replicas=1,  # one slot budget per pool: exactly one owner
            max_ongoing_requests=100_000,  # waiters park here by design
            ray_actor_options={"num_cpus": 0},
            logging_config=INTERNAL_LOGGING,
        )
        .bind(pool, admission, tenants)
    )


def _board(settings: dict | None, *schedulers: Application) -> Application:
    """The board; ``schedulers`` bound to it only so that they deploy with it (the control
    application's graph has one root)."""
    return (
        serve.deployment(BreakerBoardDeployment)
        .options(
            name=BOARD_DEPLOYMENT,
            num_replicas=1,  # one owner of every breaker: one probe, fleet-wide
            max_ongoing_requests=10_000,
            ray_actor_options={"num_cpus": 0},
            logging_config=INTERNAL_LOGGING,
        )
        .bind(settings, *schedulers)
    )


POOL_APP_INGRESS = "ingress"  # a pool application's ingress (replica/pool_ingress.py says why)
POOL_APP_INGRESS_AUTOSCALING = {"min_replicas": 0, "initial_replicas": 0, "max_replicas": 1}


def build_pool(args: dict[str, Any]) -> Application:
    """A pool as an application of its own (args ``{pool: {...}, tracing: {...}}``): a change to
    these args replaces this pool's replicas, drained, and nothing else. The gateway's
    application lists the pool with ``app:`` naming this one."""
    config = load_pool_app_config(args)
    ingress = serve.deployment(PoolApplication).options(
        name=POOL_APP_INGRESS,
        # It serves nothing, so it runs nothing: no process (~85 MiB PSS each, docs/benchmarks.md
        # "Memory") and no direct-ingress port. A call (`describe`) wakes one; it goes again
        # after Serve's downscale delays.
        autoscaling_config=POOL_APP_INGRESS_AUTOSCALING,
        max_ongoing_requests=16,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(config.pool.model_dump(), _pool_deployment(config.pool, config.tracing))


def _pool_deployment(pool: PoolConfig, tracing: TracingConfig) -> Application:
    return (
        serve.deployment(Replica)
        .options(name=pool_deployment_name(pool.name), **_replica_options(pool))
        .bind(pool.model_dump(), tracing.model_dump())
    )


def _replica_options(pool: PoolConfig) -> dict[str, Any]:
    """Serve options for a pool, with defaults that fit an LLM server rather than a web app.

    Serve's default of 5 ongoing requests per replica would starve a batching engine; twice the
    engine's batch keeps its batch full and lets a short waiting queue form inside the engine
    (as with vLLM), while the rest waits in Serve's router, which can still choose a replica.
    """
    routing = pool.routing
    options: dict[str, Any] = {
        "max_ongoing_requests": 2 * pool.engine.max_num_seqs,
        # Drain: a replica being replaced (rollout, scale-down) finishes its streams first.
        "graceful_shutdown_timeout_s": pool.request_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
        # Every pool runs Forge's router, Serve's own policy included: it is where breakers
        # exclude replicas and where a cold pool's replica count comes from.
        "request_router_config": RequestRouterConfig(
            request_router_class="serve_app.routing.serve_router:ForgeRequestRouter",
            request_router_kwargs={
                "policy": routing.policy,
                "block_size": pool.engine.block_size,
                # How the pool's engine names a prompt's blocks (vLLM's or the simulator's).
                "prompt_hashing": prompt_hashing_for(pool),
                "kv_events": routing.kv_events.model_dump(),
                "adapter_affinity": routing.adapter_affinity,
                "adapter_load_factor": routing.adapter_load_factor,
                # Past the replicas' next report of what they hold.
                "adapter_memory_s": 2 * routing.stats_period_s,
                **routing.options,
            },
            request_routing_stats_period_s=routing.stats_period_s,
        ),
    }
    options.update(pool.deployment)
    autoscaling = options.get("autoscaling_config")
    if isinstance(autoscaling, dict):
        # Scaled on the requests it serves: a gateway's feed is one more call open on a replica
        # (replica/autoscaling.py says why).
        options["autoscaling_config"] = with_pool_policy(autoscaling)
    return options
