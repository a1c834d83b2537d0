"""The Ray Serve ``RequestRouter`` that runs a Forge routing policy where Serve picks a replica.

It runs inside each caller of the pool's handle (the gateway replicas): no extra actor hop per
request. For every request it builds a ``ReplicaView`` of each candidate (Serve's cached count
of requests in flight on it, plus the replica's last published routing stats) and a
``RouteRequest`` (the prompt's block-hash chain), asks the policy for a ranking and hands Serve
one replica per rank, so Serve's own retry walks the policy's order.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from serve_app import tokenizer
from serve_app.block_hashes import prefix_block_hashes
from serve_app.bridge import pool_bridge, replica_backend
from serve_app.metrics import counter
from serve_app.protocol import prompt_text
from serve_app.resilience.breaker import Admit, State
from serve_app.routing.base import (
    ReplicaView,
    RouteRequest,
    RoutingPolicy,
    build_policy,
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
        # Per replica: its last reported block list and that list as a set (one conversion per
        # stats report, not per request). The list is kept, not its id(): a freed list's
        # address is reused by the next one, which would get the old set.
        self._blocks: dict[str, tuple[list, frozenset[int]]] = {}
        pool = self._deployment_id.name
        # The pool as the gateway names it (deployment "pool-primary" → "primary").
        self.pool = pool.removeprefix("pool-")
        self.bridge = pool_bridge(self._deployment_id.app_name, self.pool)
        self._probes: dict[str, str] = {}  # request id → the open replica it is the probe of
        self._routed = counter(
            "forge_routed_total",
            "Requests routed to each replica of a pool, by policy.",
            *("pool", "policy", "target"),
        )
        self._spillovers = counter(
            "forge_route_spillovers_total",
            "Requests whose preferred replica was over the load bound.",
            *("pool", "policy"),
        )
        for series in (self._routed, self._spillovers):
            series.set_default_tags({"pool": pool, "policy": policy})
        self.route_blocks = route_blocks

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.bridge.replica_ids = frozenset(r.replica_id.unique_id for r in replicas)
        self._blocks = {rid: v for rid, v in self._blocks.items() if rid in self.bridge.replica_ids}

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.bridge.replica_ids = frozenset(r.unique_id for r in self.curr_replicas)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        request_id = _request_id(pending_request)
        pinned = self.bridge.pinned.get(request_id) if request_id else None
        if pinned is not None:
            # A follow-up call about a request: only its replica knows. If that one is gone,
            # any replica answers (None): a call Serve cannot place would wait forever.
            target = by_id.get(pinned) or next(iter(candidate_replicas), None)
            return [[target]] if target is not None else []
        excluded = self._excluded(list(by_id), request_id)
        probe = await self._probe_for(request_id, excluded)
        if probe is not None:
            return [[by_id[probe]]] if probe in by_id else []
        views = [self._view(r, r.replica_id.unique_id in excluded) for r in candidate_replicas]
        spilled_before = getattr(self.policy, "spillovers", 0)
        ranked = self.policy.rank(views, self._route_for(pending_request))
        if getattr(self.policy, "spillovers", 0) > spilled_before:
            self._spillovers.inc()
        return [[by_id[replica_id]] for replica_id in ranked if replica_id in by_id]

    def _excluded(self, replica_ids: list[str], request_id: str | None) -> set[str]:
        """Replicas not to choose: breaker not closed, or the one this request's first try
        failed on. Never all of them: when every replica's breaker is open, the pool's own
        breaker is what keeps traffic away, and a request it let through must land somewhere."""
        breakers = self.bridge.breakers
        avoid = self.bridge.avoid.get(request_id) if request_id else None
        excluded = {
            rid
            for rid in replica_ids
            if rid == avoid
            or (
                breakers is not None
                and breakers.state(replica_backend(self.pool, rid)) is not State.CLOSED
            )
        }
        return excluded if len(excluded) < len(replica_ids) else set()

    async def _probe_for(self, request_id: str | None, excluded: set[str]) -> str | None:
        """A replica whose cool-down is over gets one request, its probe, granted fleet-wide."""
        breakers = self.bridge.breakers
        if breakers is None or request_id is None:
            return None
        known = self._probes.get(request_id)
        if known is not None:
            return known  # Serve is retrying this request's choice: keep the probe
        for rid in sorted(excluded):
            backend = replica_backend(self.pool, rid)
            if rid == self.bridge.avoid.get(request_id) or not breakers.probe_ready(backend):
                continue
            if await breakers.admit(backend) is Admit.PROBE:
                if len(self._probes) > 1_000:
                    self._probes.clear()
                self._probes[request_id] = rid
                return rid
        return None

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        rid = replica_id.unique_id
        self._routed.inc(tags={"target": rid})
        if pending_request is None:
            return
        self._routes.pop(pending_request.metadata.internal_request_id, None)
        request_id = _request_id(pending_request)
        if request_id is not None and request_id not in self.bridge.pinned:
            breakers = self.bridge.breakers
            probe = self._probes.pop(request_id, None) == rid or (
                breakers is not None
                and breakers.state(replica_backend(self.pool, rid)) is not State.CLOSED
            )
            self.bridge.note_routed(request_id, rid, probe)

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

    def _view(self, replica: RunningReplica, excluded: bool = False) -> ReplicaView:
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
            cached_blocks=self._cached_blocks(replica.replica_id.unique_id, stats),
            excluded=excluded,
        )

    def _cached_blocks(self, replica_id: str, stats: dict) -> frozenset[int]:
        blocks = stats.get("cached_blocks")
        if not blocks:
            self._blocks.pop(replica_id, None)
            return frozenset()
        known = self._blocks.get(replica_id)
        if known is not None and known[0] is blocks:
            return known[1]
        cached = frozenset(blocks)
        self._blocks[replica_id] = (blocks, cached)
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


def _request_id(pending: PendingRequest | None) -> str | None:
    """Forge's request id: the third argument of ``stream``/``complete``, or the keyword of a
    follow-up call (``abandoned_usage``); None for ``ready``."""
    if pending is None:
        return None
    if len(pending.args) >= 3 and isinstance(pending.args[2], str):
        return pending.args[2]
    request_id = pending.kwargs.get("request_id") if pending.kwargs else None
    return request_id if isinstance(request_id, str) else None
