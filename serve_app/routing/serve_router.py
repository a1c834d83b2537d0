"""The Ray Serve ``RequestRouter`` that runs a Forge routing policy where Serve picks a replica.

It runs inside each caller of the pool's handle (the gateway replicas): no extra actor hop per
request. For every request it builds a ``ReplicaView`` of each candidate (Serve's cached count
of requests in flight on it, plus the replica's last published routing stats) and a
``RouteRequest`` (the prompt's block-hash chain), asks the policy for a ranking and hands Serve
one replica per rank, so Serve's own retry walks the policy's order. A LoRA adapter's request
has that ranking reordered by adapter affinity (``routing/adapters.py``), from the adapters
each replica reports plus those this router sent it since.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from serve_app.adapters import request_adapter
from serve_app.bridge import pool_bridge, pool_of_deployment, replica_backend
from serve_app.config.models import KvEventsConfig
from serve_app.kvcache.curve import curve_keys
from serve_app.metrics import counter
from serve_app.resilience.breaker import Admit, State
from serve_app.routing.adapters import AdapterAffinity
from serve_app.routing.base import ReplicaView, RouteRequest, RoutingPolicy
from serve_app.routing.kv_aware import matched_prefix_blocks, uncached_tokens
from serve_app.routing.kv_index import KvIndex
from serve_app.routing.prompt_hashing import build_prompt_hasher
from serve_app.routing.registry import KV_EVENT_POLICIES, build_policy

# Policies that look at the prompt; the others never pay for tokenizing it.
_PREFIX_POLICIES = frozenset({"prefix_affinity", "kv_aware"})

# The longest a request waits for the index's first snapshot of a replica it has not synced
# yet (once per replica): without it, a gateway replica's first requests to a pool would route
# blind to every block the pool already holds. A snapshot takes about a millisecond here.
_FIRST_SYNC_WAIT_S = 0.25


class ForgeRequestRouter(RequestRouter):
    """No ``FIFOMixin``: it hands the replica chosen for one request to the oldest pending one,
    which would undo a per-prompt choice exactly when it matters, under load."""

    def initialize_state(
        self,
        policy: str = "round_robin",
        block_size: int = 16,
        route_blocks: int = 128,
        kv_events: dict | None = None,
        adapter_affinity: bool = True,
        adapter_load_factor: float = 1.25,
        adapter_memory_s: float = 2.0,
        prompt_hashing: dict | None = None,
        **options: Any,
    ) -> None:
        self.policy: RoutingPolicy = build_policy(policy, **options)
        self.adapters = AdapterAffinity(adapter_load_factor) if adapter_affinity else None
        # Adapters this router sent each replica, and when: the replica holds them from then
        # on, though its stats say so only at its next report (kept ``adapter_memory_s``).
        self.adapter_memory_s = adapter_memory_s
        self._sent_adapters: dict[str, dict[str, float]] = {}
        self.policy_name = policy
        self.needs_prefix = policy in _PREFIX_POLICIES
        self.block_size = block_size
        # The prompt's blocks named as the pool's engine names them (``prompt_hashing.py``).
        self.hasher = (
            build_prompt_hasher(prompt_hashing, block_size, route_blocks)
            if self.needs_prefix
            else None
        )
        # Serve calls choose_replicas again on every backoff: compute a request's route once.
        self._routes: dict[str, RouteRequest] = {}
        pool = self._deployment_id.name
        # The pool as the gateway names it (deployment "pool-primary" → "primary").
        self.pool = pool_of_deployment(pool)
        # Where each replica's blocks are, from its KV events (KV-aware policies only), over
        # sockets that the pool's config secures (``routing.kv_events``; curve by default).
        self.index = None
        if policy in KV_EVENT_POLICIES:
            events = KvEventsConfig.model_validate(kv_events or {})
            self.index = KvIndex(
                self.pool,
                keys=curve_keys(events.auth, events.curve_secret_env),
                max_message_bytes=events.max_message_bytes,
            )
        self.bridge = pool_bridge(self._deployment_id.app_name, self.pool)
        self.bridge.engine_identity = self.engine_identity
        self._agreed_identity: str | None = None
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
        self._adapter_placements = counter(
            "forge_route_adapter_placements_total",
            "LoRA adapter requests sent where the adapter was not loaded (a load there).",
            *("pool", "policy"),
        )
        # What the index expected each replica to find cached, beside vLLM's own count of what
        # it found (vllm:prefix_cache_hits, per replica): how far the index is from the engines.
        self._index_hit_tokens = counter(
            "forge_route_index_hit_tokens_total",
            "Prompt tokens the router's KV index expected the chosen replica to hold cached.",
            *("pool", "policy", "target"),
        )
        for series in (
            self._routed,
            self._spillovers,
            self._adapter_placements,
            self._index_hit_tokens,
        ):
            # The pool's name, as the gateway's and the schedulers' series give it.
            series.set_default_tags({"pool": self.pool, "policy": policy})
        self.route_blocks = route_blocks
        self._sync_waited: set[str] = set()  # replicas whose first snapshot a request awaited

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.bridge.replica_ids = frozenset(r.replica_id.unique_id for r in replicas)
        for gone in set(self._sent_adapters) - self.bridge.replica_ids:
            del self._sent_adapters[gone]
        if self.index is not None:
            self.index.keep_only(self.bridge.replica_ids)
            # Subscribe as soon as a replica says where it publishes, not at the first request.
            for replica in replicas:
                self._watch(replica)
            self._sync_waited &= self.bridge.replica_ids

    def engine_identity(self) -> str | None:
        """What the pool's replicas run, from their routing stats: the one identity they agree
        on (kept while the pool is scaled to zero), None while they differ (a roll under way:
        the cache must not key one engine's answers by the other's) or while none of the
        replicas there are has said (a roll's new replicas may run another engine)."""
        replicas = self.curr_replicas.values()
        said = {(r.routing_stats or {}).get("engine_identity") for r in replicas}
        said.discard(None)
        if len(said) > 1:
            return None
        if said:
            (self._agreed_identity,) = said
            return self._agreed_identity
        return None if replicas else self._agreed_identity

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
            return self._offer(request_id, [probe], by_id)
        if self.index is not None:
            await self._first_sync(candidate_replicas)
        views = [self._view(r, r.replica_id.unique_id in excluded) for r in candidate_replicas]
        spilled_before = getattr(self.policy, "spillovers", 0)
        if self.hasher is not None:
            self._follow_engine(candidate_replicas)
        route = self._route_for(pending_request)
        ranked = self.policy.rank(views, route)
        if getattr(self.policy, "spillovers", 0) > spilled_before:
            self._spillovers.inc()
        if route.adapter is not None and self.adapters is not None:
            placed_before = self.adapters.placements
            ranked = self.adapters.order(ranked, views, route.adapter)
            if self.adapters.placements > placed_before:
                self._adapter_placements.inc()
        return self._offer(request_id, ranked, by_id)

    def _offer(
        self, request_id: str | None, ranked: list[str], by_id: dict[str, RunningReplica]
    ) -> list[list[RunningReplica]]:
        """Serve's ranks, one replica each, noted on the bridge until Serve says which took it
        (``PoolBridge.offered``)."""
        offered = tuple(rid for rid in ranked if rid in by_id)
        if request_id is not None:
            self.bridge.note_offered(request_id, offered)
        return [[by_id[rid]] for rid in offered]

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
        adapter = _adapter_of(pending_request)
        if adapter is not None:
            self._sent_adapters.setdefault(rid, {})[adapter] = time.monotonic()
        route = self._routes.pop(pending_request.metadata.internal_request_id, None)
        request_id = _request_id(pending_request)
        if self.index is not None and route is not None and request_id is not None:
            # Count it on the replica until its engine says it took it in, and remember its
            # blocks there: the next request with this prompt follows it.
            held = self.index.holds(rid)
            uncached = uncached_tokens(route, held)
            # An adapter's blocks are cached under hashes keyed by its LoRA: unless the hasher
            # keys them so too (vLLM's), its prefill counts, its blocks are not remembered.
            keyed = route.adapter is None or self.hasher.keys_adapters
            expected = matched_prefix_blocks(route.block_hashes, held) * route.block_size
            if keyed and expected > 0:
                self._index_hit_tokens.inc(expected, tags={"target": rid})
            blocks = route.block_hashes if keyed else ()
            self.index.assign(request_id, rid, uncached, blocks)
        if request_id is not None and request_id not in self.bridge.pinned:
            self.bridge.offered.pop(request_id, None)  # routed: no longer a guess
            breakers = self.bridge.breakers
            probe = self._probes.pop(request_id, None) == rid or (
                breakers is not None
                and breakers.state(replica_backend(self.pool, rid)) is not State.CLOSED
            )
            self.bridge.note_routed(request_id, rid, probe)

    def _follow_engine(self, replicas: list[RunningReplica]) -> None:
        """Name blocks as the pool's engine says it does (the first replica that says)."""
        for replica in replicas:
            hashing = (replica.routing_stats or {}).get("block_hashing")
            if hashing:
                self.hasher.follow(hashing)
                return

    def _watch(self, replica: RunningReplica) -> bool:
        """Subscribe the index to the replica's KV events; False if it publishes none (yet)."""
        where = (replica.routing_stats or {}).get("kv_events")
        if not where:
            return False
        self.index.watch(replica.replica_id.unique_id, where["endpoint"], where["snapshot"])
        return True

    async def _first_sync(self, candidates: list[RunningReplica]) -> None:
        """Wait (briefly, once per replica) for the index to hold each candidate's blocks."""
        new = [
            r.replica_id.unique_id
            for r in candidates
            if r.replica_id.unique_id not in self._sync_waited and self._watch(r)
        ]
        if not new:
            return
        self._sync_waited.update(new)
        deadline = time.monotonic() + _FIRST_SYNC_WAIT_S
        # Polled: the index syncs on its own thread, and this runs once per new replica.
        while not all(self.index.watching(rid) for rid in new) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.002)

    def _route_for(self, pending: PendingRequest | None) -> RouteRequest:
        if pending is None:
            return RouteRequest()
        if not self.needs_prefix:
            return RouteRequest(adapter=_adapter_of(pending))
        key = pending.metadata.internal_request_id
        route = self._routes.get(key)
        if route is None:
            if len(self._routes) > 10_000:  # requests cancelled before routing: forget them
                self._routes.clear()
            route = self._routes[key] = self._route_request(pending)
        return route

    def _view(self, replica: RunningReplica, excluded: bool = False) -> ReplicaView:
        stats = replica.routing_stats or {}
        replica_id = replica.replica_id.unique_id
        # Serve's cached count of the replica's ongoing requests (its last report, bumped on
        # every request this router sends): fresh enough to balance on, cheap to read.
        in_flight = self.replica_queue_len_cache.get(replica.replica_id) or 0
        running = int(stats.get("num_requests_running", 0))
        waiting = int(stats.get("num_requests_waiting", 0))
        cached_blocks: Collection[int] = frozenset()
        backlog = 0
        if self.index is not None:
            self._watch(replica)
            load = self.index.load(replica_id)
            if load is not None:  # milliseconds old, where the stats are up to a period old
                running, waiting, backlog = load.running, load.waiting, load.backlog
            backlog += self.index.assigned_tokens(replica_id)
            cached_blocks = self.index.holds(replica_id)
        adapters, busy = self._adapters_on(replica_id, stats)
        return ReplicaView(
            adapters=adapters,
            busy_adapters=busy,
            adapter_slots=int(stats.get("max_loras", 0)),
            replica_id=replica_id,
            in_flight=in_flight,
            running=running,
            waiting=waiting,
            kv_cache_usage=float(stats.get("kv_cache_usage_perc", 0.0)),
            cached_blocks=cached_blocks,
            backlog_tokens=backlog,
            excluded=excluded,
        )

    def _adapters_on(self, replica_id: str, stats: dict) -> tuple[frozenset[str], frozenset[str]]:
        """The adapters a replica holds (loaded, running or waiting as it last reported, and
        those this router sent it within ``adapter_memory_s``; older sends are forgotten), and
        of those the busy ones: running or waiting there, or just sent."""
        busy = [*stats.get("running_lora_adapters", ()), *stats.get("waiting_lora_adapters", ())]
        sent = self._sent_adapters.get(replica_id)
        if sent:
            since = time.monotonic() - self.adapter_memory_s
            for adapter, at in list(sent.items()):
                if at < since:
                    del sent[adapter]
            busy += sent
        return frozenset([*stats.get("lora_adapters", ()), *busy]), frozenset(busy)

    def _route_request(self, pending: PendingRequest | None) -> RouteRequest:
        """The prompt's block hashes, from the call ``stream/complete(body, kind, request_id)``."""
        if pending is None or len(pending.args) < 2 or not isinstance(pending.args[0], dict):
            return RouteRequest()
        return self.hasher.route(pending.args[0], pending.args[1])


def _adapter_of(pending: PendingRequest) -> str | None:
    """The adapter of a ``stream``/``complete`` call's body (None: the base model, or not one)."""
    body = pending.args[0] if pending.args else None
    return request_adapter(body) if isinstance(body, dict) else None


def _request_id(pending: PendingRequest | None) -> str | None:
    """Forge's request id: the third argument of ``stream``/``complete``, or the keyword of a
    follow-up call (``abandoned_usage``); None for ``ready``."""
    if pending is None:
        return None
    if len(pending.args) >= 3 and isinstance(pending.args[2], str):
        return pending.args[2]
    request_id = pending.kwargs.get("request_id") if pending.kwargs else None
    return request_id if isinstance(request_id, str) else None
