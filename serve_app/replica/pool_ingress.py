"""The ingress of a pool's own application (``serve_app.app:build_pool``).

Serve gives every application an ingress deployment, and with direct ingress on (HAProxy,
throughput-optimized mode) an ingress replica opens its own HTTP and gRPC ports, counts its
requests as ingress traffic for autoscaling and is held at least 30 s when it stops. None of
that fits a pool's replicas: they take requests only through the gateway's handle and must
drain as the pool's own ``graceful_shutdown_timeout_s`` says (12 s on spot T4s). So the pool is
a child deployment and this one, which serves nothing, is the application's ingress. It runs at
zero replicas (``serve_app/app.py``): no process, no port; Serve wakes one for a call to
``describe`` and lets it go after its downscale delays.
"""

from __future__ import annotations

from ray.serve.handle import DeploymentHandle

from serve_app.config.models import PoolConfig


class PoolApplication:
    def __init__(self, pool: dict, replicas: DeploymentHandle) -> None:
        self.pool = PoolConfig.model_validate(pool)
        self.replicas = replicas  # held so Serve deploys the pool with its application

    def describe(self) -> dict:
        """What this application runs (for operators and tests: ``serve.get_app_handle``)."""
        return {
            "pool": self.pool.name,
            "model": self.pool.model,
            "task": self.pool.task,
            "engine_identity": self.pool.engine_identity(),
        }
