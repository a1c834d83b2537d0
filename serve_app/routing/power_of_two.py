"""Power of two choices: Serve's own default, as a Forge policy so breakers apply to it too.

Two replicas at random, the one with fewer requests in flight first: nearly the balance of
least-in-flight, without every gateway replica herding onto the same "least" replica between
two load reports.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from serve_app.routing.base import ReplicaView, RouteRequest, RoutingPolicy, eligible


class PowerOfTwoPolicy(RoutingPolicy):
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def rank(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> list[str]:
        candidates = sorted(eligible(replicas), key=lambda r: r.replica_id)
        self._rng.shuffle(candidates)
        head = sorted(candidates[:2], key=lambda r: r.in_flight)  # stable: a tie stays random
        rest = sorted(candidates[2:], key=lambda r: r.in_flight)
        return [r.replica_id for r in head + rest]
