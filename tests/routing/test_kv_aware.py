"""KV-aware: longest cached leading prefix against load, with a load guard and a fallback."""

from __future__ import annotations

import pytest

from serve_app.routing import KvAwarePolicy, ReplicaView, RouteRequest, matched_prefix_blocks

BLOCKS = tuple(range(100, 108))
REQUEST = RouteRequest(BLOCKS)


def replica(
    replica_id: str, cached: tuple[int, ...] = (), load: int = 0, **kw: bool
) -> ReplicaView:
    return ReplicaView(replica_id, in_flight=load, cached_blocks=frozenset(cached), **kw)


def test_matched_prefix_counts_leading_blocks_only() -> None:
    assert matched_prefix_blocks(BLOCKS, frozenset(BLOCKS[:3])) == 3
    assert matched_prefix_blocks(BLOCKS, frozenset(BLOCKS[1:])) == 0  # first block missing
    assert matched_prefix_blocks(BLOCKS, frozenset({100, 101, 103})) == 2
    assert matched_prefix_blocks((), frozenset(BLOCKS)) == 0


def test_prefers_the_longest_matching_prefix() -> None:
    replicas = [
        replica("a", BLOCKS[:2]),
        replica("b", BLOCKS[:6]),
        replica("c"),
        replica("d", BLOCKS[1:]),  # holds 7 blocks, but not the first: useless
    ]
    assert KvAwarePolicy().rank(replicas, REQUEST) == ["b", "a", "c", "d"]


def test_score_trades_matched_blocks_against_load() -> None:
    # b: 6 matched, load 1; a: 2 matched, load 0. Both within the bound (mean 1/3, bound 1.42).
    replicas = [replica("a", BLOCKS[:2]), replica("b", BLOCKS[:6], load=1), replica("c")]
    assert KvAwarePolicy(load_weight=2).rank(replicas, REQUEST)[0] == "b"  # 6 - 2 > 2 - 0
    assert KvAwarePolicy(load_weight=5).rank(replicas, REQUEST)[0] == "a"  # 6 - 5 < 2 - 0


def test_load_guard_spills_a_hot_prefix_and_returns() -> None:
    policy = KvAwarePolicy(load_weight=0)  # match only: the guard alone must stop the pile-up

    def rank(hot_load: int) -> list[str]:
        replicas = [
            replica("hot", BLOCKS, load=hot_load),
            replica("warm", BLOCKS[:1], load=4),
            replica("cold", load=4),
        ]
        return policy.rank(replicas, REQUEST)

    # Bound = 1.25 × (8 + L) / 3 + 1: L = 7 is within it (7 ≤ 7.25), L = 8 is not (8 > 7.67).
    assert rank(7) == ["hot", "warm", "cold"]
    assert policy.spillovers == 0
    assert rank(8) == ["warm", "cold", "hot"]
    assert policy.spillovers == 1
    assert rank(7)[0] == "hot"


def test_no_match_anywhere_falls_back_to_least_loaded() -> None:
    replicas = [replica("a", (1, 2), load=2), replica("b", load=1), replica("c", load=1)]
    assert KvAwarePolicy().rank(replicas, REQUEST) == ["b", "c", "a"]
    assert KvAwarePolicy().rank([replica("a", BLOCKS, load=2), replica("b")], RouteRequest(())) == [
        "b",
        "a",
    ]


def test_excluded_replica_is_never_chosen_and_the_next_applies() -> None:
    replicas = [
        replica("best", BLOCKS, excluded=True),
        replica("next", BLOCKS[:4]),
        replica("none"),
    ]
    assert KvAwarePolicy().rank(replicas, REQUEST) == ["next", "none"]
    assert KvAwarePolicy().rank(replicas[:1], REQUEST) == []


def test_reported_queue_counts_as_load() -> None:
    busy = ReplicaView("busy", in_flight=0, running=8, waiting=6, cached_blocks=frozenset(BLOCKS))
    idle = replica("idle", BLOCKS[:4])
    assert KvAwarePolicy(load_weight=0).rank([busy, idle], REQUEST) == ["idle", "busy"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"load_weight": -1}, "load_weight"), ({"load_factor": 0.5}, "load_factor")],
)
def test_rejects_bad_parameters(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KvAwarePolicy(**kwargs)
