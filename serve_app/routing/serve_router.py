"""The Ray Serve ``RequestRouter`` that runs a Forge routing policy where Serve picks a replica.

It runs inside each caller of the pool's handle (the gateway replicas): no extra actor hop per
request. For every request it builds a ``ReplicaView`` of each candidate (Serve's cached count
of requests in flight on it, plus the replica's last published routing stats) and a
``RouteRequest`` (the prompt's block-hash chain), asks the policy for a ranking and hands Serve
one replica per rank, so Serve's own retry walks the policy's order.
"""

from __future__ import annotations

from typing import Any

from ray.serve.metrics import Counter
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from serve_app import tokenizer
from serve_app.protocol import prompt_text
from serve_app.routing.base import (
    ReplicaView,
    RouteRequest,
    RoutingPolicy,
    build_policy,
    prefix_block_hashes,
)

# Enough text for the first blocks a policy looks at; tokenizing a 100 kB prompt per request
# to hash 4 blocks of it would cost more than the routing decision.
_PREFIX_CHARS = 16_384


# Policies that look at the prompt; the others never pay for tokenizing it.
_PREFIX_POLICIES = frozenset({"prefix_affinity", "kv_aware"})


class ForgeRequestRouter(RequestRouter):
    """No ``FIFOMixin``: it hands the replica chosen for one request to the oldest pending one,
    which would undo a per-prompt choice exactly when it matters, under load."""

    def initialize_state(
        self,
        policy: str = "round_robin",
        block_size: int = 16,
        route_blocks: int = 64,
        **options: Any,
    ) -> None:
        self.policy: RoutingPolicy = build_policy(policy, **options)
        self.policy_name = policy
        self.needs_prefix = policy in _PREFIX_POLICIES
        self.block_size = block_size
        # Serve calls choose_replicas again on every backoff: compute a request's route once.
        self._routes: dict[str, RouteRequest] = {}
        self._blocks: dict[int, frozenset[int]] = {}  # per stats snapshot, not per request
        pool = self._deployment_id.name
        self._routed = Counter(
            "forge_routed_total",
            description="Requests routed to each replica of a pool, by policy.",
            tag_keys=("pool", "policy", "target"),
        )
        self._spillovers = Counter(
            "forge_route_spillovers_total",
            description="Requests whose preferred replica was over the load bound.",
            tag_keys=("pool", "policy"),
        )
        for counter in (self._routed, self._spillovers):
            counter.set_default_tags({"pool": pool, "policy": policy})
        self.route_blocks = route_blocks

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        views = [self._view(r) for r in candidate_replicas]
        spilled_before = getattr(self.policy, "spillovers", 0)
        ranked = self.policy.rank(views, self._route_for(pending_request))
        if getattr(self.policy, "spillovers", 0) > spilled_before:
            self._spillovers.inc()
        return [[by_id[replica_id]] for replica_id in ranked if replica_id in by_id]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self._routed.inc(tags={"target": replica_id.unique_id})
        if pending_request is not None:
            self._routes.pop(pending_request.metadata.internal_request_id, None)

    def _route_for(self, pending: PendingRequest | None) -> RouteRequest:
        if not self.needs_prefix or pending is None:
            return RouteRequest()
        key = pending.metadata.internal_request_id
        route = self._routes.get(key)
        if route is None:
            if len(self._routes) > 10_000:  # requests cancelled before routing: forget them
                self._routes.clear()
            route = self._routes[key] = self._route_request(pending)
        return route

    def _view(self, replica: RunningReplica) -> ReplicaView:
        stats = replica.routing_stats or {}
        # Serve's cached count of the replica's ongoing requests (its last report, bumped on
        # every request this router sends): fresh enough to balance on, cheap to read.
        in_flight = self.replica_queue_len_cache.get(replica.replica_id) or 0
        return ReplicaView(
            replica_id=replica.replica_id.unique_id,
            in_flight=in_flight,
            running=int(stats.get("num_requests_running", 0)),
            waiting=int(stats.get("num_requests_waiting", 0)),
            kv_cache_usage=float(stats.get("kv_cache_usage_perc", 0.0)),
            cached_blocks=self._cached_blocks(stats),
        )

    def _cached_blocks(self, stats: dict) -> frozenset[int]:
        blocks = stats.get("cached_blocks")
        if not blocks:
            return frozenset()
        key = id(blocks)  # a new snapshot is a new list
        cached = self._blocks.get(key)
        if cached is None:
            if len(self._blocks) > 64:
                self._blocks.clear()
            cached = self._blocks[key] = frozenset(blocks)
        return cached

    def _route_request(self, pending: PendingRequest | None) -> RouteRequest:
        """The prompt's block hashes, from the call ``stream/complete(body, kind, request_id)``."""
        if pending is None or len(pending.args) < 2 or not isinstance(pending.args[0], dict):
            return RouteRequest()
        body, kind = pending.args[0], pending.args[1]
        try:
            text = prompt_text(body, kind)[:_PREFIX_CHARS]
        except (KeyError, IndexError, TypeError):
            return RouteRequest()
        ids = tokenizer.encode(text)[: self.block_size * self.route_blocks]
        return RouteRequest(prefix_block_hashes(ids, self.block_size))
