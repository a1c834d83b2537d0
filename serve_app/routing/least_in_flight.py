"""Least in flight: the replica with the fewest requests this gateway has in flight on it."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from serve_app.routing.base import ReplicaView, RouteRequest, RoutingPolicy, eligible

TieBreak = Literal["random", "id"]


class LeastInFlightPolicy(RoutingPolicy):
    """Fewest ``in_flight`` first: Serve's router-side count, fresher than any replica report.

    Ties (the common case on an idle fleet, where every count is 0):

    - ``"random"`` (default): ties are shuffled by a ``random.Random(seed)``. Without this, every
      sequential request on an idle fleet, from every gateway replica, lands on the lowest id.
      A seed makes the sequence reproducible (tests, experiments); the shuffle does not depend on
      the order the replicas are given in.
    - ``"id"``: ties go to the lowest id; fully deterministic, same choice on every gateway.
    """

    name = "least_in_flight"

    def __init__(self, tie_break: TieBreak = "random", seed: int | None = None) -> None:
        if tie_break not in ("random", "id"):
            raise ValueError(f"tie_break must be 'random' or 'id', got {tie_break!r}")
        self.tie_break = tie_break
        self._rng = random.Random(seed)

    def rank(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> list[str]:
        candidates = sorted(eligible(replicas), key=lambda r: r.replica_id)
        if self.tie_break == "random":
            jitter = {r.replica_id: self._rng.random() for r in candidates}
            candidates.sort(key=lambda r: (r.in_flight, jitter[r.replica_id]))
        else:
            candidates.sort(key=lambda r: r.in_flight)  # stable: ties stay in id order
        return [r.replica_id for r in candidates]
