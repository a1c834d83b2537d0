"""Shared routing pieces: the replica view and the load bound."""

from __future__ import annotations

from serve_app.routing import ReplicaView
from serve_app.routing.base import bounded_load_order


def view(replica_id: str, load: int) -> ReplicaView:
    return ReplicaView(replica_id, in_flight=load)


def test_load_counts_in_flight_running_and_waiting() -> None:
    # b: 1 + 2 + 3 = 6 > 1.25 × mean(0, 6) + 1 = 4.75, so it spills behind a.
    replicas = [ReplicaView("b", in_flight=1, running=2, waiting=3), ReplicaView("a", in_flight=0)]
    assert bounded_load_order(replicas, 1.25) == (["a", "b"], True)


def test_bounded_load_order_keeps_preference_under_the_bound() -> None:
    # mean 1, bound 2.25: nobody over it.
    assert bounded_load_order([view("c", 2), view("a", 1), view("b", 0)], 1.25) == (
        ["c", "a", "b"],
        False,
    )
    assert bounded_load_order([], 1.25) == ([], False)
