"""Round robin: the baseline every other policy is measured against."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from serve_app.routing.base import ReplicaView, RouteRequest, RoutingPolicy, eligible


class RoundRobinPolicy(RoutingPolicy):
    """Rotates over the eligible replicas sorted by id; the ranking is the rotation.

    The cursor is the id chosen last, not an index, so a replica leaving or being excluded only
    skips it: the next call starts at the first eligible id after the last choice. Each gateway
    replica keeps its own cursor; that is harmless, as each one still spreads evenly.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def rank(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> list[str]:
        ids = sorted(r.replica_id for r in eligible(replicas))
        if not ids:
            return []
        start = 0 if self._last is None else bisect_right(ids, self._last) % len(ids)
        order = ids[start:] + ids[:start]
        self._last = order[0]
        return order
