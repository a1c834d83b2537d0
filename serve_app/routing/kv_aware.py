"""KV-aware: send a request where the longest prefix of its prompt is already cached.

The index of which replica holds which blocks is not kept by the gateway: it is the replicas' own
reports (``ReplicaView.cached_blocks``, from each replica's routing stats), read afresh on every
request. Every gateway replica therefore sees the same index and makes the same choice, and there
is no per-gateway copy to diverge or to rebuild after a restart. The price is staleness: a prefix
cached since a replica's last report is invisible until the next one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from serve_app.routing.base import (
    ReplicaView,
    RouteRequest,
    RoutingPolicy,
    bounded_load_order,
    eligible,
    least_loaded,
    replica_load,
)


def matched_prefix_blocks(block_hashes: Sequence[int], cached: Collection[int]) -> int:
    """How many of the request's leading blocks the replica holds (stops at the first miss).

    Only a leading run is usable: a cached block after a missing one cannot be reused, since the
    engine must prefill the gap and everything after it.
    """
    matched = 0
    for block_hash in block_hashes:
        if block_hash not in cached:
            break
        matched += 1
    return matched


class KvAwarePolicy(RoutingPolicy):
    """Best first by ``score = matched_blocks - load_weight × load``, under a load bound.

    Why this formula: sending the request to replica ``r`` costs roughly the prefill of the
    blocks it does not hold, ``(n - matched_r) × t_block``, plus the delay its load adds,
    ``load_r × t_load``. Minimising that is maximising ``matched_r - (t_load / t_block) × load_r``,
    so ``load_weight`` is the cost of one unit of load expressed in prefilled blocks. The default
    16 (one request ≈ prefilling 256 tokens at block size 16) sits between what one more running
    sequence (~12 blocks) and one more waiting request (~45 blocks) cost under the simulated
    engine's costs in ``configs/local.yaml``; tune it per engine.

    - ``matched_blocks``: ``matched_prefix_blocks`` against the replica's ``cached_blocks``.
    - ``load``: ``replica_load`` (``in_flight + running + waiting``).
    - Ties: lower load, then id.
    - **Load guard**: as in prefix affinity, replicas whose load > ``load_factor`` × mean + 1 go
      to the back of the ranking, so a hot prefix cannot melt the replica that holds it however
      large its match; ``spillovers`` counts requests whose best-scoring replica was over it.
    - **No match anywhere** (or no full block): least-loaded, ties by id.
    """

    name = "kv_aware"

    def __init__(self, load_weight: float = 16.0, load_factor: float = 1.25) -> None:
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        if load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.load_weight = load_weight
        self.load_factor = load_factor
        self.spillovers = 0

    def rank(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> list[str]:
        candidates = eligible(replicas)
        matched = {
            r.replica_id: matched_prefix_blocks(request.block_hashes, r.cached_blocks)
            for r in candidates
        }
        if not any(matched.values()):
            return least_loaded(candidates)

        def order(r: ReplicaView) -> tuple[float, int, str]:
            load = replica_load(r)
            return (-(matched[r.replica_id] - self.load_weight * load), load, r.replica_id)

        ranking, spilled = bounded_load_order(sorted(candidates, key=order), self.load_factor)
        self.spillovers += spilled
        return ranking
