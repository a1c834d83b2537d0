"""Least queue: the replica whose own reported queue is shortest."""

from __future__ import annotations

from collections.abc import Sequence

from serve_app.routing.base import ReplicaView, RouteRequest, RoutingPolicy, eligible


class LeastQueuePolicy(RoutingPolicy):
    """Best first by ``(waiting, running + in_flight, kv_cache_usage, replica_id)``.

    ``waiting`` dominates: a request sent to a replica with a queue waits for a whole slot to
    free, while one more running sequence only slows each decode step a little. Among replicas
    with equal queues, the busier batch (the replica's ``running`` plus what this gateway has in
    flight, which covers requests sent since the last report) loses, then the fuller KV cache
    (the one closer to making admissions wait for blocks). The id makes ties deterministic.
    """

    name = "least_queue"

    def rank(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> list[str]:
        ordered = sorted(
            eligible(replicas),
            key=lambda r: (r.waiting, r.running + r.in_flight, r.kv_cache_usage, r.replica_id),
        )
        return [r.replica_id for r in ordered]
