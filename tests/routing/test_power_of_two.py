"""Power of two choices: the lighter of two random replicas; never an excluded one."""

from __future__ import annotations

from collections import Counter

from serve_app.routing import ReplicaView, RouteRequest
from serve_app.routing.registry import build_policy

REQUEST = RouteRequest(())


def test_the_lighter_of_the_two_sampled_goes_first_and_the_busiest_never_does() -> None:
    policy = build_policy("power_of_two", seed=3)
    replicas = [ReplicaView("a", 0), ReplicaView("b", 5), ReplicaView("c", 9)]
    firsts = Counter(policy.rank(replicas, REQUEST)[0] for _ in range(300))
    assert firsts["c"] == 0  # it loses every pair it is drawn in
    assert firsts["a"] > firsts["b"] > 0  # "b" wins only the pairs without "a"


def test_every_eligible_replica_is_ranked_and_excluded_ones_never_are() -> None:
    policy = build_policy("power_of_two", seed=1)
    replicas = [ReplicaView("a", 0, excluded=True), ReplicaView("b", 2), ReplicaView("c", 1)]
    for _ in range(20):
        assert sorted(policy.rank(replicas, REQUEST)) == ["b", "c"]
    assert policy.rank([ReplicaView("a", 0, excluded=True)], REQUEST) == []
