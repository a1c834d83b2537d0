"""The routing policies by name: the one list, derived from the classes themselves.

A new policy is a module with a ``RoutingPolicy`` subclass and one line in ``_CLASSES``; its
``name`` is what a pool's config says, and the config's choices are read from here.
"""

from __future__ import annotations

import inspect
from typing import Any

from serve_app.routing.base import RoutingPolicy
from serve_app.routing.kv_aware import KvAwarePolicy
from serve_app.routing.least_in_flight import LeastInFlightPolicy
from serve_app.routing.least_queue import LeastQueuePolicy
from serve_app.routing.power_of_two import PowerOfTwoPolicy
from serve_app.routing.prefix_affinity import PrefixAffinityPolicy
from serve_app.routing.round_robin import RoundRobinPolicy

_CLASSES: tuple[type[RoutingPolicy], ...] = (
    PowerOfTwoPolicy,
    RoundRobinPolicy,
    LeastInFlightPolicy,
    LeastQueuePolicy,
    PrefixAffinityPolicy,
    KvAwarePolicy,
)
POLICIES: dict[str, type[RoutingPolicy]] = {cls.name: cls for cls in _CLASSES}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)
# Policies whose pools' replicas publish KV-cache events and whose routers index them.
KV_EVENT_POLICIES = frozenset(name for name, cls in POLICIES.items() if cls.uses_kv_events)


def build_policy(name: str, **kwargs: Any) -> RoutingPolicy:
    """The policy registered under ``name``, built with ``kwargs``; errors name the bad input."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(
            f"unknown routing policy {name!r}; expected one of: {', '.join(POLICY_NAMES)}"
        )
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise ValueError(f"routing policy {name!r}: {exc}") from None
    return cls(**kwargs)
