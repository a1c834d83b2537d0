"""Prefix affinity: a consistent hash of the prompt's opening blocks, with bounded load.

Requests that share a system prompt land on the same replica, so its prefix cache serves them;
pure consistent hashing would let one popular prompt melt that replica, so a replica over the
load bound hands its requests to the next replica on the ring (and gets them back once its load
drops). Everything is a function of the replica ids, the request and the reported loads: every
gateway replica makes the same choice, with no shared state.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence

from serve_app.routing.base import (
    ReplicaView,
    RouteRequest,
    RoutingPolicy,
    bounded_load_order,
    eligible,
    least_loaded,
    stable_hash64,
)

_MASK64 = (1 << 64) - 1


class HashRing:
    """``vnodes`` points per replica on a 64-bit ring; a key belongs to the next point clockwise.

    Points are ``stable_hash64("<replica_id>#<i>")``, so the ring depends only on the set of ids:
    removing a replica moves only the keys that were on its points (about 1/N of them), each to
    the replica that follows on the ring.
    """

    def __init__(self, replica_ids: Iterable[str], vnodes: int) -> None:
        self.replica_ids = frozenset(replica_ids)
        points = sorted(
            (stable_hash64(f"{rid}#{i}".encode()), rid)
            for rid in self.replica_ids
            for i in range(vnodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [rid for _, rid in points]

    def walk(self, key: int) -> list[str]:
        """Every replica id once, in ring order starting from ``key``'s owner."""
        n = len(self._points)
        start = bisect_right(self._points, key)
        seen: dict[str, None] = {}
        for i in range(n):
            seen.setdefault(self._owners[(start + i) % n])
            if len(seen) == len(self.replica_ids):
                break
        return list(seen)


class PrefixAffinityPolicy(RoutingPolicy):
    """Consistent hashing on the first ``prefix_blocks`` block hashes, with bounded load.

    - **Key**: ``stable_hash64`` of the first ``prefix_blocks`` block hashes (system prompt
      first; fewer if the prompt has fewer full blocks). A request with no full block has no
      prefix worth keeping and goes to the least-loaded replica.
    - **Ring**: built over every live replica, excluded ones included, so a breaker that opens
      and closes again does not reshuffle keys; the walk skips excluded replicas, which is the
      same as removing them from the ring.
    - **Bounded load**: load is ``replica_load`` (``in_flight + running + waiting``). The
      preferred replica keeps the request unless its load > ``load_factor`` × mean load + 1
      (mean over eligible replicas); then the first replica along the ring walk that is not over
      the bound. The ranking is the walk order with the over-bound replicas moved to the back.
    - ``spillovers`` counts requests whose preferred replica was over the bound (for metrics).
    """

    name = "prefix_affinity"

    def __init__(self, prefix_blocks: int = 4, vnodes: int = 64, load_factor: float = 1.25) -> None:
        if prefix_blocks < 1:
            raise ValueError(f"prefix_blocks must be >= 1, got {prefix_blocks}")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        if load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.prefix_blocks = prefix_blocks
        self.vnodes = vnodes
        self.load_factor = load_factor
        self.spillovers = 0
        self._ring = HashRing((), vnodes)

    def key(self, request: RouteRequest) -> int:
        head = request.block_hashes[: self.prefix_blocks]
        return stable_hash64(b"".join((h & _MASK64).to_bytes(8, "little") for h in head))

    def on_replicas_changed(self, replica_ids: Sequence[str]) -> None:
        self._ring_for(replica_ids)

    def _ring_for(self, replica_ids: Iterable[str]) -> HashRing:
        ids = frozenset(replica_ids)
        if ids != self._ring.replica_ids:
            self._ring = HashRing(ids, self.vnodes)
        return self._ring

    def rank(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> list[str]:
        if not eligible(replicas):
            return []
        if not request.block_hashes:
            return least_loaded(replicas)
        views = {r.replica_id: r for r in replicas}
        walk = [
            views[rid]
            for rid in self._ring_for(views).walk(self.key(request))
            if not views[rid].excluded
        ]
        ranking, spilled = bounded_load_order(walk, self.load_factor)
        self.spillovers += spilled
        return ranking
