"""The gateway as a Serve deployment: Serve handles wired into the gateway's typed seams.

This is the only place that knows the gateway runs on Ray Serve: pools are reached through their
handles (the pool's router, in this process, keeps its bridge current), the schedulers and the
breaker board through typed clients over theirs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

from ray import serve
from ray.serve._private.constants import RAY_SERVE_LOG_TO_STDERR
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from serve_app.admission.client import ServeSchedulerClient
from serve_app.admission.deployment import scheduler_deployment_name
from serve_app.auth.keys import KeyRing
from serve_app.backends.base import Backend
from serve_app.backends.fallback import FallbackBackend
from serve_app.backends.pool import PoolBackend, pool_timeouts
from serve_app.bridge import pool_bridge, pool_deployment_name
from serve_app.config.models import ForgeConfig
from serve_app.gateway.server import Gateway
from serve_app.metrics import ForgeMetrics
from serve_app.replica import admin as replica_admin
from serve_app.resilience.board import BOARD_DEPLOYMENT, ServeBoard
from serve_app.resilience.client import BreakerClient
from serve_app.resilience.settings import breaker_client_options
from serve_app.stack import Collaborators
from serve_app.store import build_stores
from serve_app.tracing import tracer_for

logger = logging.getLogger("ray.serve")


def _by_name(deployment: str, app: str) -> DeploymentHandle:
    """A deployment in another application (a pool's own, the control application), by name.
    Not checked against the controller: the applications of one Serve config deploy
    concurrently, and until its replicas exist its calls wait (a pool's requests wait or fail
    over, as for a pool scaled to zero; a scheduler's fail open)."""
    return serve.get_deployment_handle(deployment, app_name=app, _check_exists=False)


def _control_handles(forge: ForgeConfig) -> tuple[dict[str, DeploymentHandle], DeploymentHandle]:
    """The schedulers and the board in the control application."""
    app = forge.control_app
    schedulers = {
        pool.name: _by_name(scheduler_deployment_name(pool.name), app)
        for pool in forge.pools
        if pool.admission is not None
    }
    return schedulers, _by_name(BOARD_DEPLOYMENT, app)


@serve.ingress()
class GatewayIngress(Gateway):
    def __init__(
        self,
        config: dict,
        pools: dict[str, DeploymentHandle],
        schedulers: dict[str, DeploymentHandle],
        board: DeploymentHandle | None,
    ) -> None:
        forge = ForgeConfig.model_validate(config)
        if forge.control_app is not None:
            schedulers, board = _control_handles(forge)
        # A control application's scheduler starts with no settings: it is sent this replica's.
        settings = self._settings_of if forge.control_app else lambda _pool: None
        metrics = ForgeMetrics()
        # Fails start-up, with the variable's name, if a Redis is configured but unresolvable.
        stores = build_stores(forge, on_state=metrics.store_changed)
        breakers = BreakerClient(
            ServeBoard(board),
            forge.resilience.sync_interval_s,
            on_board_error=lambda op: metrics.board_errors.inc(tags={"op": op}),
            **breaker_client_options(forge.resilience),
        )
        app = serve.get_replica_context().app_name
        backends: dict[str, Backend] = {}
        for pool in forge.pools:
            # The router is keyed by the application the pool's deployment is in.
            bridge = pool_bridge(pool.app or app, pool.name)
            bridge.breakers = breakers  # what the pool's router reads in this process
            handle = (
                pools[pool.name]
                if pool.app is None
                else _by_name(pool_deployment_name(pool.name), pool.app)
            )
            backends[pool.name] = PoolBackend(pool.name, handle, pool_timeouts(pool), bridge)
        if forge.fallback is not None:
            backends["fallback"] = FallbackBackend(forge.fallback)  # a missing key stops start-up
        parts = Collaborators(
            keyring=KeyRing.from_config(forge),
            store=stores.main,
            metrics=metrics,
            backends=backends,
            schedulers={
                name: ServeSchedulerClient(h, settings(name)) for name, h in schedulers.items()
            },
            breakers=breakers,
            tracer=tracer_for(forge.tracing, "forge-gateway"),
            usage_store=stores.usage,
            cache_store=stores.cache,
        )
        super().__init__(forge, parts)

    def _settings_of(self, pool: str) -> Callable[[], tuple[dict, list[dict]]]:
        """What a control application's scheduler that has none yet is sent: this replica's
        settings for the pool at the moment it asks."""
        return lambda: self.live.scheduler_settings(pool)

    async def served_by_a_peer(self) -> dict | None:
        """A running replica's live change, through a handle to this deployment: Serve routes
        the call to replicas that run, never to this one, which is still starting."""
        context = serve.get_replica_context()
        handle = serve.get_deployment_handle(context.deployment, app_name=context.app_name)
        return await handle.served_user_config.remote()

    def check_health(self) -> None:
        """Serve's health check (also part of start-up): a gateway with no tenant would answer
        every request 401, which is a configuration error, not a running service."""
        if not self.config.tenants:
            raise RuntimeError(
                "no tenants: list them in the gateway deployment's user_config (or the "
                "application's args)"
            )

    def __serve_build_asgi_app__(self) -> Starlette:
        # Serve calls this on the replica's event loop, before it hands the replica its port:
        # a task waits for the port, then says where this replica listens.
        self._listening_announcement = asyncio.get_running_loop().create_task(
            self._announce_listening()
        )
        return self.asgi_app()

    async def _announce_listening(self) -> None:
        """One line once this replica is up: where its requests come in.

        It goes to the replica's Serve log, and to the terminal of ``serve run``: Ray forwards a
        replica's stderr to the driver, but throughput-optimized Serve sends its logs to files
        only (``RAY_SERVE_LOG_TO_STDERR=0``), so the line is then written to stderr as well.
        """
        context = serve.get_replica_context()
        try:
            where = await replica_admin.listening_addresses(context)
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
