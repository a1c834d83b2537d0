"""Reach one replica by its id: read its engine stats, set its injected fault.

Serve handles route each call to a replica of their choosing; operators, drills and tests need
the opposite (this replica, that fault). Replicas are named Ray actors, so this module calls
the user method on the named replica actor the same way a handle would. It touches Serve's
private request metadata and controller, on purpose in this one place, and is never on the
request path (the gateway's start-up line asks it where the replica listens).
"""

from __future__ import annotations

import asyncio
import pickle
import uuid

import ray
from ray.serve._private.common import RequestMetadata
from ray.serve._private.constants import (
    RAY_SERVE_ENABLE_DIRECT_INGRESS,
    RAY_SERVE_ENABLE_HA_PROXY,
    SERVE_CONTROLLER_NAME,
    SERVE_NAMESPACE,
)
from ray.serve.config import ProxyLocation
from ray.serve.context import ReplicaContext

from serve_app.admission.deployment import scheduler_deployment_name
from serve_app.resilience.board import BOARD_DEPLOYMENT

_PREFIX = "SERVE_REPLICA::"


def replica_ids(app: str, deployment: str) -> list[str]:
    """Ids of the live replicas of one deployment, e.g. of the pool ``pool-primary``."""
    prefix = f"{_PREFIX}{app}#{deployment}#"
    return sorted(
        a["name"][len(prefix) :]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(prefix)
    )


def _call(app: str, deployment: str, replica_id: str, method: str, *args):
    actor = ray.get_actor(f"{_PREFIX}{app}#{deployment}#{replica_id}", namespace=SERVE_NAMESPACE)
    rid = uuid.uuid4().hex
    metadata = RequestMetadata(
        request_id=rid, internal_request_id=rid, call_method=method, app_name=app
    )
    return actor.handle_request.remote(pickle.dumps(metadata), *args)


def stats(app: str, deployment: str, replica_id: str, timeout_s: float = 10.0) -> dict:
    return ray.get(_call(app, deployment, replica_id, "stats"), timeout=timeout_s)


def set_fault(
    app: str, deployment: str, replica_id: str, spec: dict | None, timeout_s: float = 10.0
) -> dict:
    """Set (or with ``None`` clear) the fault of one replica; see ``faults.FaultSpec``."""
    return ray.get(_call(app, deployment, replica_id, "set_fault", spec), timeout=timeout_s)


def all_stats(app: str, deployment: str) -> list[dict]:
    return [stats(app, deployment, r) for r in replica_ids(app, deployment)]


def set_fault_all(app: str, deployment: str, spec: dict | None) -> list[str]:
    ids = replica_ids(app, deployment)
    for r in ids:
        set_fault(app, deployment, r, spec)
    return ids


def direct_ingress_url(app: str) -> str | None:
    """The HTTP URL of one of the app's ingress replicas when Serve runs with direct ingress."""
    urls = direct_ingress_urls(app)
    return urls[0] if urls else None


def direct_ingress_urls(app: str) -> list[str]:
    """The HTTP URL of each of the app's ingress replicas (none without direct ingress)."""
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    groups = ray.get(controller.get_target_groups.remote(app, RAY_SERVE_ENABLE_HA_PROXY))
    return [f"http://{target.ip}:{target.port}" for target in _replica_targets(groups)]


def _replica_targets(groups) -> list:
    """The ingress replicas among target groups. With HAProxy on, Serve lists HAProxy as the
    app's target unless asked as HAProxy's manager, and then Serve's own proxy beside the
    replicas (its backup): keep the replicas."""
    return [
        target
        for group in groups
        if group.protocol == "HTTP"
        for target in group.targets
        if target.name.startswith(_PREFIX)
    ]


def breaker_states(app: str) -> dict[str, tuple[int, float]]:
    """Every breaker that is not closed: ``{backend: (state, seconds until a probe may try)}``."""
    return _board(app, "sync", [])


def describe_breakers(app: str) -> dict[str, dict]:
    """Every breaker the board knows: state, retry_in_s, transitions, probes granted."""
    return _board(app, "describe")


def reset_breakers(app: str, backend: str | None = None) -> None:
    """Close one breaker, or all; gateway replicas hear of it on their next sync."""
    _board(app, "reset", backend)


def scheduler_snapshot(app: str, pool: str) -> dict:
    """A pool's fair-admission numbers: slots used and parked, queues, in flight by tenant."""
    return _single(app, scheduler_deployment_name(pool), "snapshot")


def _board(app: str, method: str, *args, timeout_s: float = 10.0):
    return _single(app, BOARD_DEPLOYMENT, method, *args, timeout_s=timeout_s)


def _single(app: str, deployment: str, method: str, *args, timeout_s: float = 10.0):
    """Call a deployment that has exactly one replica (the board, a pool's scheduler), in
    ``app`` or, where the gateway's application ``app`` has a control application, there."""
    replicas = replica_ids(app, deployment)
    if not replicas:
        app = _only_app_with(deployment)
        replicas = replica_ids(app, deployment)
    (replica,) = replicas
    return ray.get(_call(app, deployment, replica, method, *args), timeout=timeout_s)


def _only_app_with(deployment: str) -> str:
    apps = {
        a["name"][len(_PREFIX) :].split("#")[0]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == SERVE_NAMESPACE
        and a["name"].startswith(_PREFIX)
        and a["name"][len(_PREFIX) :].split("#")[1:2] == [deployment]
    }
    if len(apps) != 1:
        raise LookupError(f"{len(apps)} applications have a {deployment!r} deployment")
    return apps.pop()


# How long a new replica waits for Serve to list its direct-ingress port before it says where it
# listens without it (a replica is listed once it is running: seconds).
DIRECT_PORT_WAIT_S = 120.0


async def listening_addresses(context: ReplicaContext) -> str:
    """Where an ingress replica takes requests (for its start-up line): Serve's proxy, and its
    own direct-ingress port once the controller lists it (up to ``DIRECT_PORT_WAIT_S``)."""
    controller = await asyncio.to_thread(
        ray.get_actor, SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE
    )
    http = await controller.get_http_config.remote()
    location = await controller.get_proxy_location.remote()
    if location == ProxyLocation.Disabled:
        proxy = "no Serve proxy (proxy_location: Disabled)"
    elif RAY_SERVE_ENABLE_HA_PROXY:
        proxy = f"http://{http.host}:{http.port} via HAProxy ({location.value})"
    else:
        proxy = f"http://{http.host}:{http.port} via Serve's proxy ({location.value})"
    if not RAY_SERVE_ENABLE_DIRECT_INGRESS:
        return proxy
    # Serve lists an ingress replica's own HTTP port once the replica is running.
    actor_name = context.replica_id.to_full_id_str()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DIRECT_PORT_WAIT_S
    while True:
        groups = await controller.get_target_groups.remote(
            context.app_name, RAY_SERVE_ENABLE_HA_PROXY
        )
        for target in _replica_targets(groups):
            if target.name == actor_name:
                return (
                    f"{proxy}, and http://{target.ip}:{target.port} "
                    "(this replica's own port: direct ingress)"
                )
        if loop.time() >= deadline:
            return (
                f"{proxy} (direct ingress is on, but Serve listed no port for this replica "
                f"within {DIRECT_PORT_WAIT_S:g} s)"
            )
        await asyncio.sleep(0.5)
