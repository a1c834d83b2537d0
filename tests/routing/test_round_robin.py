"""Round robin: a rotation over eligible replicas by id."""

from __future__ import annotations

from serve_app.routing import ReplicaView, RoundRobinPolicy, RouteRequest

REQUEST = RouteRequest(())


def views(*ids: str, excluded: tuple[str, ...] = ()) -> list[ReplicaView]:
    return [ReplicaView(i, in_flight=0, excluded=i in excluded) for i in ids]


def test_cycles_in_id_order_whatever_the_input_order() -> None:
    policy = RoundRobinPolicy()
    replicas = views("c", "a", "b")
    firsts = [policy.rank(replicas, REQUEST)[0] for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]


def test_ranking_is_the_rotation_from_the_cursor() -> None:
    policy = RoundRobinPolicy()
    replicas = views("a", "b", "c")
    assert policy.rank(replicas, REQUEST) == ["a", "b", "c"]
    assert policy.rank(replicas, REQUEST) == ["b", "c", "a"]
    assert policy.rank(replicas, REQUEST) == ["c", "a", "b"]


def test_skips_excluded_replicas() -> None:
    policy = RoundRobinPolicy()
    replicas = views("a", "b", "c", excluded=("b",))
    ranks = [policy.rank(replicas, REQUEST) for _ in range(4)]
    assert [r[0] for r in ranks] == ["a", "c", "a", "c"]
    assert all("b" not in r for r in ranks)


def test_exclusion_mid_cycle_continues_after_the_last_choice() -> None:
    policy = RoundRobinPolicy()
    assert policy.rank(views("a", "b", "c"), REQUEST)[0] == "a"
    assert policy.rank(views("a", "b", "c", excluded=("b",)), REQUEST)[0] == "c"
    assert policy.rank(views("a", "b", "c"), REQUEST)[0] == "a"


def test_last_choice_gone_resumes_at_the_next_id() -> None:
    policy = RoundRobinPolicy()
    policy.rank(views("a", "b", "c"), REQUEST)
    policy.rank(views("a", "b", "c"), REQUEST)  # chose b
    assert policy.rank(views("a", "c"), REQUEST) == ["c", "a"]


def test_nothing_eligible_gives_an_empty_ranking() -> None:
    policy = RoundRobinPolicy()
    assert policy.rank([], REQUEST) == []
    assert policy.rank(views("a", excluded=("a",)), REQUEST) == []
