"""KV-aware: send a request where it waits for the least prefill, its own and what is queued.

Where each replica's blocks live comes from the replicas' KV events (``ReplicaView.
cached_blocks``, the router's ``KvIndex``: milliseconds behind the engines), plus the blocks
this router itself just sent there, so a prompt no replica holds yet is assigned once and then
followed. Every gateway replica applies the same events, so they agree on where a prompt lives
up to the few requests each is sending at that moment.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from serve_app.routing.base import (
    ReplicaView,
    RouteRequest,
    RoutingPolicy,
    bounded_load_order,
    eligible,
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


def uncached_tokens(request: RouteRequest, cached: Collection[int]) -> int:
    """The prompt tokens a replica holding ``cached`` would still have to prefill."""
    prompt = max(request.prompt_tokens, len(request.block_hashes) * request.block_size)
    matched = matched_prefix_blocks(request.block_hashes, cached)
    return max(0, prompt - matched * request.block_size)


class KvAwarePolicy(RoutingPolicy):
    """Best first by the prefill work the request would wait for, under a load bound.

    All in prompt tokens, the unit of prefill work (its cost per token is the same everywhere,
    so it cancels out):

    - ``load`` of a replica = ``backlog_tokens`` (uncached prompt tokens queued or mid-prefill
      on it, as its events last said, plus what this router sent since) +
      ``request_cost_tokens`` × its requests (in flight or in its engine). The second term is
      the slot a request holds for its whole decode, which a prefill-only count would miss: a
      replica full of cached requests is still full.
    - ``score`` = ``load`` + the request's own uncached tokens there (``prompt_tokens`` −
      matched blocks × block size). Lowest first: a request leaves the replica holding its
      prefix only when the queue there costs more than prefilling the prefix elsewhere.
    - Ties: fewer uncached tokens (the holder), then id (every gateway replica agrees).
    - **Load bound** (``bound``), by default on requests: a replica with more than
      ``load_factor`` × the mean + 1 requests goes to the back, so one hot prompt cannot take
      every slot of the replica that holds it; ``spillovers`` counts requests whose best replica
      was over it. ``bound="tokens"`` bounds ``load`` instead (slack: one request's cost). Not
      the default: a backlog is transient and the score already prices it, and a bound on it
      moved cached requests off a replica busy with one cold prefill onto replicas that then
      prefilled the whole prompt (measured in ``docs/routing.md``).

    ``request_cost_tokens`` default 64: a waiting request waits for the next slot to free, about
    a decode's length over ``max_num_seqs`` (16 tokens × ~14 ms / 8 ≈ 28 ms here), which is what
    ~100 prompt tokens cost to prefill at 0.2 ms each; 64 leans towards keeping affinity.
    ``load_factor`` default 1.5: the experiment's knee between hit rate and balance.
    """

    name = "kv_aware"
    uses_kv_events = True

    def __init__(
        self, request_cost_tokens: float = 64.0, load_factor: float = 1.5, bound: str = "requests"
    ) -> None:
        if request_cost_tokens < 0:
            raise ValueError(f"request_cost_tokens must be >= 0, got {request_cost_tokens}")
        if load_factor < 1:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        if bound not in ("requests", "tokens"):
            raise ValueError(f"bound must be 'requests' or 'tokens', got {bound!r}")
        self.request_cost_tokens = request_cost_tokens
        self.load_factor = load_factor
        self.bound = bound
        self.spillovers = 0

    @staticmethod
    def requests(replica: ReplicaView) -> int:
        """Requests on the replica: in flight to it (Serve's count) or in its engine."""
        return max(replica.in_flight, replica.running + replica.waiting)

    def load(self, replica: ReplicaView) -> float:
        return replica.backlog_tokens + self.request_cost_tokens * self.requests(replica)

    def rank(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> list[str]:
        candidates = eligible(replicas)
        uncached = {r.replica_id: uncached_tokens(request, r.cached_blocks) for r in candidates}

        def order(r: ReplicaView) -> tuple[float, int, str]:
            # Fewer uncached tokens is more matched blocks: the tie-break prefers the holder.
            return (self.load(r) + uncached[r.replica_id], uncached[r.replica_id], r.replica_id)

        if self.bound == "tokens":
            bounded, slack = self.load, max(1.0, self.request_cost_tokens)
        else:
            bounded, slack = self.requests, 1.0
        ranking, spilled = bounded_load_order(
            sorted(candidates, key=order), self.load_factor, load=bounded, slack=slack
        )
        self.spillovers += spilled
        return ranking
