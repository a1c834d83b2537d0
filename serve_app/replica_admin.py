"""Reach one replica by its id: read its engine stats, set its injected fault.

Serve handles route each call to a replica of their choosing; operators, drills and tests need
the opposite (this replica, that fault). Replicas are named Ray actors, so this module calls
the user method on the named replica actor the same way a handle would. It touches Serve's
private request metadata, on purpose in this one place, and is never on the request path.
"""

from __future__ import annotations

import pickle
import uuid

import ray
from ray.serve._private.common import RequestMetadata
from ray.serve._private.constants import SERVE_NAMESPACE

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
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    for group in details.get("target_groups", []):
        if group.get("app_name") == app and group.get("protocol", "HTTP") == "HTTP":
            for target in group.get("targets", []):
                return f"http://{target['ip']}:{target['port']}"
    return None


def breaker_states(app: str) -> dict[str, tuple[int, float]]:
    """Every breaker that is not closed: ``{backend: (state, seconds until a probe may try)}``."""
    return _board(app, "sync", [])


def describe_breakers(app: str) -> dict[str, dict]:
    """Every breaker the board knows: state, retry_in_s, transitions, probes granted."""
    return _board(app, "describe")


def reset_breakers(app: str, backend: str | None = None) -> None:
    """Close one breaker, or all; gateway replicas hear of it on their next sync."""
    _board(app, "reset", backend)


def _board(app: str, method: str, *args, timeout_s: float = 10.0):
    (board,) = replica_ids(app, "breaker-board")
    return ray.get(_call(app, "breaker-board", board, method, *args), timeout=timeout_s)
