"""Least in flight: fewest of this gateway's in-flight requests, ties by id or seeded random."""

from __future__ import annotations

from collections import Counter

import pytest

from serve_app.routing import LeastInFlightPolicy, ReplicaView, RouteRequest

REQUEST = RouteRequest(())


def test_fewest_in_flight_first_ties_by_id() -> None:
    policy = LeastInFlightPolicy(tie_break="id")
    replicas = [
        ReplicaView("c", in_flight=1),
        ReplicaView("b", in_flight=3),
        ReplicaView("a", in_flight=1),
        ReplicaView("d", in_flight=0, running=50, waiting=50),  # reports are not its signal
    ]
    assert policy.rank(replicas, REQUEST) == ["d", "a", "c", "b"]


def test_excluded_replicas_never_appear() -> None:
    policy = LeastInFlightPolicy(tie_break="id")
    replicas = [ReplicaView("a", in_flight=0, excluded=True), ReplicaView("b", in_flight=5)]
    assert policy.rank(replicas, REQUEST) == ["b"]
    assert policy.rank([ReplicaView("a", in_flight=0, excluded=True)], REQUEST) == []


def test_random_ties_spread_and_are_reproducible_with_a_seed() -> None:
    replicas = [ReplicaView(i, in_flight=0) for i in "abcd"] + [ReplicaView("e", in_flight=1)]

    def firsts(seed: int, order: list[ReplicaView]) -> list[str]:
        policy = LeastInFlightPolicy(seed=seed)
        return [policy.rank(order, REQUEST)[0] for _ in range(400)]

    run = firsts(7, replicas)
    assert run == firsts(7, list(reversed(replicas)))  # input order does not matter
    counts = Counter(run)
    assert set(counts) == set("abcd")  # never the busier e
    assert min(counts.values()) > 60  # ~100 each
    assert LeastInFlightPolicy(seed=7).rank(replicas, REQUEST)[-1] == "e"


def test_rejects_an_unknown_tie_break() -> None:
    with pytest.raises(ValueError, match="tie_break"):
        LeastInFlightPolicy(tie_break="first")  # type: ignore[arg-type]
