"""Routing policies: pure logic ranking a pool's replicas for each request (no Ray here).

The Ray Serve ``RequestRouter`` adapter builds the views and calls ``RoutingPolicy.rank``.
"""

from serve_app.routing.base import ReplicaView, RouteRequest, RoutingPolicy, replica_load
from serve_app.routing.kv_aware import KvAwarePolicy, matched_prefix_blocks
from serve_app.routing.least_in_flight import LeastInFlightPolicy
from serve_app.routing.least_queue import LeastQueuePolicy
from serve_app.routing.prefix_affinity import HashRing, PrefixAffinityPolicy
from serve_app.routing.registry import POLICY_NAMES, build_policy
from serve_app.routing.round_robin import RoundRobinPolicy

__all__ = [
    "POLICY_NAMES",
    "HashRing",
    "KvAwarePolicy",
    "LeastInFlightPolicy",
    "LeastQueuePolicy",
    "PrefixAffinityPolicy",
    "ReplicaView",
    "RoundRobinPolicy",
    "RouteRequest",
    "RoutingPolicy",
    "build_policy",
    "matched_prefix_blocks",
    "replica_load",
]
