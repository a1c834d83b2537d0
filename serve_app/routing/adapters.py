"""Adapter affinity: a LoRA adapter's requests go where the adapter is loaded, under a load bound.

**A layer the policies share, not a policy of its own.** Which replica has an adapter loaded is
a constraint on top of whatever a pool routes by: a pool of tenants' fine-tunes still wants its
prefix cache (``prefix_affinity``, ``kv_aware``) or its queue lengths (``least_queue``) to decide
among the replicas that hold the adapter, and among those that would load it. As a policy it
would replace them; as a layer it reorders the ranking the pool's policy made, so every policy
gets it (llm-d's scheduler does the same: a LoRA-affinity scorer beside the others). vLLM keys
its prefix cache by adapter too, so the two never pull apart: an adapter's cached blocks can
only be on replicas that served the adapter.

The reordering, for a request of adapter ``a`` (the policy's order kept within each group):

1. replicas that have ``a`` loaded (or just sent it: ``ReplicaView.adapters``) and are not
   over the load bound;
2. replicas under the bound with a free adapter slot (loading ``a`` evicts nothing);
3. replicas under the bound with an idle adapter (one no request is running or was just sent):
   loading ``a`` evicts it, as the engine's LRU would;
4. other replicas under the bound: every slot is in use, so ``a`` waits there for one;
5. replicas over the bound.

The bound is ``prefix_affinity``'s: ``load > load_factor × mean load + 1``, load being
``in_flight + running + waiting`` and the mean over the eligible replicas. So an adapter stays
on the replicas that hold it until they run hot, then loads on another replica (and spreads
there from then on, since that one holds it too). Base-model requests are not reordered.
Pure, like the policies: every gateway replica reorders alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from serve_app.routing.base import ReplicaView, replica_load


class AdapterAffinity:
    """Reorders a policy's ranking for a LoRA adapter's request (the module docstring says how).

    ``placements`` counts requests whose first choice did not hold the adapter (a load there,
    unless another request just loaded it); ``spillovers`` those whose holders were all over
    the bound while one held it.
    """

    def __init__(self, load_factor: float = 1.25) -> None:
        if load_factor < 1:
            raise ValueError(f"adapter_load_factor must be >= 1, got {load_factor}")
        self.load_factor = load_factor
        self.placements = 0
        self.spillovers = 0

    def order(
        self, ranking: Sequence[str], replicas: Sequence[ReplicaView], adapter: str
    ) -> list[str]:
        views = {r.replica_id: r for r in replicas}
        ranked = [views[rid] for rid in ranking if rid in views]
        if not ranked:
            return list(ranking)
        loads = {r.replica_id: replica_load(r) for r in ranked}
        bound = self.load_factor * (sum(loads.values()) / len(loads)) + 1
        groups: tuple[list[str], ...] = ([], [], [], [], [])
        for view in ranked:
            if loads[view.replica_id] > bound:
                group = 4
            elif adapter in view.adapters:
                group = 0
            elif view.adapter_slots > len(view.adapters):
                group = 1
            elif set(view.adapters) - set(view.busy_adapters):
                group = 2
            else:
                group = 3
            groups[group].append(view.replica_id)
        if not groups[0]:
            self.placements += 1
            if any(adapter in views[rid].adapters for rid in groups[4]):
                self.spillovers += 1
        return [rid for group in groups for rid in group]
