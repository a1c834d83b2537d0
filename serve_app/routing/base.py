"""What every routing policy shares: the replica and request views and the interface.

Policies are pure: no Ray, no I/O, no clock. The Ray Serve ``RequestRouter`` adapter builds a
``ReplicaView`` of each live replica for every request (its own in-flight count plus the routing
stats the replica last published), a ``RouteRequest`` from the prompt, and asks the pool's policy
for a ranking. Replicas whose breaker is open arrive with ``excluded=True`` and never appear in a
ranking, so the adapter's next choice is simply the next id in the list.

Load, wherever a policy needs one number (``replica_load``), is ``in_flight + running + waiting``.
``running`` saturates at ``max_num_seqs``, so a replica that is melting shows it only in
``waiting``; ``in_flight`` is Serve's cached count of the replica's ongoing requests (its last
probe, bumped by every request this router sends), fresher than the replica's own numbers,
which are as old as its last stats report. The sum counts requests twice once a report catches
up with them; that overestimate is the safe direction for a load bound (stale stats under a
burst would otherwise undercount), and since every replica is scaled alike it barely moves a
bound that is relative to the mean.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One live replica as the router sees it for one request."""

    replica_id: str
    in_flight: int  # ongoing requests on it, as Serve's router last counted them
    running: int = 0  # the replica's routing stats: num_requests_running
    waiting: int = 0  # num_requests_waiting
    kv_cache_usage: float = 0.0  # 0..1, kv_cache_usage_perc
    # Prefix-cache block hashes it holds (its KV events, plus what this router just sent it).
    cached_blocks: Collection[int] = frozenset()
    # Prompt tokens still to prefill on it: what it reported queued plus what this router sent
    # since (``routing/kv_index.py``).
    backlog_tokens: int = 0
    excluded: bool = False  # e.g. its circuit breaker is open: never chosen
    # LoRA adapters loaded on it (or running, waiting, or just sent there by this router), and
    # how many it may hold at once (its engine's max_loras; 0: unknown): ``routing/adapters.py``.
    adapters: Collection[str] = frozenset()
    busy_adapters: Collection[str] = frozenset()  # of those, running or just sent there
    adapter_slots: int = 0


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about a request: its prompt's block hash chain, system prompt first.

    Empty when the prompt is shorter than one block (or the adapter has no token ids).
    ``prompt_tokens`` counts the prompt's tokens as far as the router read it.
    """

    block_hashes: tuple[int, ...] = ()
    prompt_tokens: int = 0
    block_size: int = 16
    adapter: str | None = None  # the LoRA adapter that serves it (None: the base model)


class RoutingPolicy(ABC):
    """Ranks replicas for one request, best first.

    ``rank`` is called exactly once per routed request (round robin advances on each call).
    Excluded replicas never appear in the ranking; it is empty when no replica is eligible.
    """

    name: ClassVar[str]  # what a pool's ``routing.policy`` says (``routing/registry.py``)
    # Fed by the replicas' KV-cache events (``serve_app/kvcache/events.py``): the replicas of a
    # pool with such a policy publish them, and its routers keep an index of them.
    uses_kv_events: ClassVar[bool] = False

    @abstractmethod
    def rank(self, replicas: Sequence[ReplicaView], request: RouteRequest) -> list[str]:
        """Replica ids, best first."""

    def on_replicas_changed(self, replica_ids: Sequence[str]) -> None:  # noqa: B027
        """The deployment's replica set changed; policies with per-set state may rebuild it."""


def stable_hash64(data: bytes) -> int:
    """A 64-bit hash that is the same on every gateway replica (ring points, ring keys)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def eligible(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    return [r for r in replicas if not r.excluded]


def replica_load(replica: ReplicaView) -> int:
    """``in_flight + running + waiting``; the module docstring says why all three."""
    return replica.in_flight + replica.running + replica.waiting


def least_loaded(replicas: Sequence[ReplicaView]) -> list[str]:
    """Eligible ids by ``replica_load``, ties by id so every gateway replica agrees."""
    return [
        r.replica_id
        for r in sorted(eligible(replicas), key=lambda r: (replica_load(r), r.replica_id))
    ]


def bounded_load_order(
    preference: Sequence[ReplicaView],
    load_factor: float,
    load: Callable[[ReplicaView], float] = replica_load,
    slack: float = 1,
) -> tuple[list[str], bool]:
    """Keep ``preference`` order but move replicas over the load bound to the back.

    Bound: a replica is over it when ``load > load_factor × mean load + slack``, the mean taken
    over ``preference`` (the eligible replicas). The slack (one request, in ``load``'s unit)
    keeps a nearly idle fleet from spilling on every request. Some replica is always at or
    under the mean, so with ``load_factor >= 1`` the head of the result is never over the bound.
    Returns the ranking and whether the preferred replica spilled over.
    """
    if not preference:
        return [], False
    loads = [load(r) for r in preference]
    bound = load_factor * (sum(loads) / len(loads)) + slack
    under = [r.replica_id for r, load in zip(preference, loads, strict=True) if load <= bound]
    over = [r.replica_id for r, load in zip(preference, loads, strict=True) if load > bound]
    return under + over, loads[0] > bound
