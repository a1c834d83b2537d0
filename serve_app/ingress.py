"""The gateway as a Serve deployment: Serve handles wired into the gateway's typed seams.

This is the only place that knows the gateway runs on Ray Serve: pools are reached through their
handles (the pool's router, in this process, keeps its bridge current), the schedulers and the
breaker board through typed clients over theirs.
"""

from __future__ import annotations

import asyncio
import logging
import sys

import ray
from ray import serve
from ray.serve._private.constants import (
    RAY_SERVE_ENABLE_DIRECT_INGRESS,
    RAY_SERVE_LOG_TO_STDERR,
    SERVE_CONTROLLER_NAME,
    SERVE_NAMESPACE,
)
from ray.serve.config import ProxyLocation
from ray.serve.context import ReplicaContext
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from serve_app.auth import KeyRing
from serve_app.backends.base import Backend
from serve_app.backends.fallback import FallbackBackend
from serve_app.backends.pool import PoolBackend, pool_timeouts
from serve_app.bridge import pool_bridge
from serve_app.config import ForgeConfig
from serve_app.gateway import Gateway
from serve_app.metrics import ForgeMetrics
from serve_app.resilience.board import ServeBoard
from serve_app.resilience.client import BreakerClient
from serve_app.scheduler_deployment import ServeSchedulerClient
from serve_app.stack import Collaborators
from serve_app.store import build_store
from serve_app.tracing import tracer_for

logger = logging.getLogger("ray.serve")


@serve.ingress()
class GatewayIngress(Gateway):
    def __init__(
        self,
        config: dict,
        pools: dict[str, DeploymentHandle],
        schedulers: dict[str, DeploymentHandle],
        board: DeploymentHandle,
    ) -> None:
        forge = ForgeConfig.model_validate(config)
        metrics = ForgeMetrics()
        # Fails start-up, with the variable's name, if Redis is configured but unresolvable.
        store = build_store(forge.store, on_state=lambda s: metrics.store_state.set(int(s)))
        breakers = BreakerClient(
            ServeBoard(board),
            forge.resilience.sync_interval_s,
            on_board_error=lambda op: metrics.board_errors.inc(tags={"op": op}),
        )
        app = serve.get_replica_context().app_name
        backends: dict[str, Backend] = {}
        for pool in forge.pools:
            bridge = pool_bridge(app, pool.name)
            bridge.breakers = breakers  # what the pool's router reads in this process
            backends[pool.name] = PoolBackend(
                pool.name, pools[pool.name], pool_timeouts(pool), bridge
            )
        if forge.fallback is not None:
            backends["fallback"] = FallbackBackend(forge.fallback)  # a missing key stops start-up
        parts = Collaborators(
            keyring=KeyRing.from_config(forge),
            store=store,
            metrics=metrics,
            backends=backends,
            schedulers={name: ServeSchedulerClient(h) for name, h in schedulers.items()},
            breakers=breakers,
            tracer=tracer_for(forge.tracing, "forge-gateway"),
        )
        super().__init__(forge, parts)

    def __serve_build_asgi_app__(self) -> Starlette:
        # Serve calls this on the replica's event loop, before it hands the replica its port:
        # a task waits for the port, then says where this replica listens.
        self._listening_announcement = asyncio.get_running_loop().create_task(
            self._announce_listening()
        )
        return self.asgi_app()

    # How long a new replica waits for Serve to list its direct-ingress port before it says
    # where it listens without it (a replica is listed once it is running: seconds).
    _DIRECT_PORT_WAIT_S = 120.0

    async def _announce_listening(self) -> None:
        """One line once this replica is up: where its requests come in.

        It goes to the replica's Serve log, and to the terminal of ``serve run``: Ray forwards a
        replica's stderr to the driver, but throughput-optimized Serve sends its logs to files
        only (``RAY_SERVE_LOG_TO_STDERR=0``), so the line is then written to stderr as well.
        """
        context = serve.get_replica_context()
        try:
            where = await self._listening_addresses(context)
        except Exception as err:  # a start-up note must never fail a replica
            where = f":8000 via Serve's proxy (its options were not readable: {err!r})"
        message = (
            f"Forge gateway replica {context.replica_id.unique_id} "
            f"(app '{context.app_name}') is listening: {where}"
        )
        logger.info(message)
        if not RAY_SERVE_LOG_TO_STDERR:
            sys.__stderr__.write(f"INFO {message}\n")
            sys.__stderr__.flush()

    async def _listening_addresses(self, context: ReplicaContext) -> str:
        controller = await asyncio.to_thread(
            ray.get_actor, SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE
        )
        http = await controller.get_http_config.remote()
        location = await controller.get_proxy_location.remote()
        if location == ProxyLocation.Disabled:
            proxy = "no Serve proxy (proxy_location: Disabled)"
        else:
            proxy = f"http://{http.host}:{http.port} via Serve's proxy ({location.value})"
        if not RAY_SERVE_ENABLE_DIRECT_INGRESS:
            return proxy
        # Serve lists an ingress replica's own HTTP port once the replica is running.
        actor_name = context.replica_id.to_full_id_str()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._DIRECT_PORT_WAIT_S
        while True:
            for group in await controller.get_target_groups.remote(context.app_name):
                if group.protocol != "HTTP":
                    continue
                for target in group.targets:
                    if target.name == actor_name:
                        return (
                            f"{proxy}, and http://{target.ip}:{target.port} "
                            "(this replica's own port: direct ingress)"
                        )
            if loop.time() >= deadline:
                return (
                    f"{proxy} (direct ingress is on, but Serve listed no port for this replica "
                    f"within {self._DIRECT_PORT_WAIT_S:g} s)"
                )
            await asyncio.sleep(0.5)
