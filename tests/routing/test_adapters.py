"""Adapter affinity (``routing/adapters.py``): a LoRA adapter's requests go where it is loaded,
under the load bound, and load where a slot is free when they must."""

from __future__ import annotations

from serve_app.routing.adapters import AdapterAffinity
from serve_app.routing.base import ReplicaView


def view(rid: str, load: int = 0, adapters=(), slots: int = 2, busy=()) -> ReplicaView:
    return ReplicaView(
        rid,
        in_flight=load,
        adapters=frozenset(adapters),
        busy_adapters=frozenset(busy),
        adapter_slots=slots,
    )


def test_a_replica_holding_the_adapter_goes_first_whatever_the_policy_ranked():
    replicas = [view("a"), view("b", adapters={"x"}), view("c")]
    affinity = AdapterAffinity()
    assert affinity.order(["a", "b", "c"], replicas, "x") == ["b", "a", "c"]
    assert affinity.placements == 0


def test_holders_keep_the_policys_order_among_themselves():
    replicas = [view("a", adapters={"x"}), view("b", adapters={"x"}), view("c")]
    assert AdapterAffinity().order(["b", "c", "a"], replicas, "x") == ["b", "a", "c"]


def test_without_a_holder_a_free_slot_comes_before_an_eviction():
    replicas = [view("a", adapters={"p", "q"}), view("b", adapters={"p"}), view("c")]
    affinity = AdapterAffinity()
    assert affinity.order(["a", "b", "c"], replicas, "x") == ["b", "c", "a"]
    assert affinity.placements == 1


def test_a_hot_holder_spills_to_another_replica_which_then_loads_it():
    # Mean load 4, bound 1.25 x 4 + 1 = 6: the holder at 10 is over it.
    replicas = [view("a", load=10, adapters={"x"}), view("b", load=1), view("c", load=1)]
    affinity = AdapterAffinity(load_factor=1.25)
    assert affinity.order(["a", "b", "c"], replicas, "x") == ["b", "c", "a"]
    assert (affinity.placements, affinity.spillovers) == (1, 1)
    # Under the bound it keeps the request: mean 5 / 3, bound 3.08.
    replicas[0] = view("a", load=3, adapters={"x"})
    assert affinity.order(["b", "a", "c"], replicas, "x")[0] == "a"


def test_only_the_policys_ranking_is_reordered_nothing_added():
    replicas = [view("a", adapters={"x"}), view("b")]
    assert AdapterAffinity().order(["b"], replicas, "x") == ["b"]  # "a" was excluded


def test_a_replica_with_an_idle_adapter_to_evict_comes_before_one_whose_slots_are_all_busy():
    replicas = [
        view("a", adapters={"p", "q"}, busy={"p", "q"}),
        view("b", adapters={"p", "q"}, busy={"p"}),
    ]
    # On "a" the request would wait for a slot; on "b" it evicts the idle "q" and runs.
    assert AdapterAffinity().order(["a", "b"], replicas, "x") == ["b", "a"]
