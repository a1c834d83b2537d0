"""App builders: the ``import_path`` targets of Forge's Ray Serve config files.

``build_app`` validates the config's ``args`` and wires the graph with handles: one replica
deployment per primary pool, and the gateway ingress that holds their handles and the fallback
client. ``serve run configs/local.yaml`` and a KubeRay ``RayService`` both go through here.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from serve_app.config import load_config
from serve_app.gateway import GatewayIngress
from serve_app.replica import Replica


def build_app(args: dict[str, Any]) -> Application:
    config = load_config(args)
    pools = {
        pool.name: serve.deployment(Replica)
        .options(name=f"pool-{pool.name}", **pool.deployment)
        .bind(pool.model_dump())
        for pool in config.pools
    }
    gateway = serve.deployment(GatewayIngress).options(name="gateway", **config.gateway.deployment)
    return gateway.bind(config.model_dump(), pools)
