"""Prefix affinity: consistent hashing of the opening blocks, bounded load, ring stability."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from serve_app.routing import PrefixAffinityPolicy, ReplicaView, RouteRequest

IDS = ("r0", "r1", "r2", "r3")


def idle(ids: tuple[str, ...] = IDS, **loads: int) -> list[ReplicaView]:
    return [ReplicaView(i, in_flight=loads.get(i, 0)) for i in ids]


def random_requests(n: int, seed: int = 0, blocks: int = 6) -> list[RouteRequest]:
    rng = random.Random(seed)
    return [RouteRequest(tuple(rng.getrandbits(64) for _ in range(blocks))) for _ in range(n)]


def homes(
    policy: PrefixAffinityPolicy, ids: tuple[str, ...], requests: list[RouteRequest]
) -> list[str]:
    return [policy.rank(idle(ids), r)[0] for r in requests]


@pytest.fixture
def policy() -> PrefixAffinityPolicy:
    return PrefixAffinityPolicy()


@pytest.fixture
def request_() -> RouteRequest:
    return RouteRequest((11, 22, 33, 44, 55))


def test_same_prefix_same_replica_whatever_follows(policy: PrefixAffinityPolicy) -> None:
    head = (101, 102, 103, 104)
    first = policy.rank(idle(), RouteRequest((*head, 1, 2, 3)))
    assert policy.rank(idle(), RouteRequest((*head, 9))) == first
    assert PrefixAffinityPolicy().rank(idle(), RouteRequest(head)) == first  # another gateway
    assert sorted(first) == list(IDS)  # the ranking is the whole ring walk


def test_only_the_first_prefix_blocks_are_the_key() -> None:
    two = PrefixAffinityPolicy(prefix_blocks=2)
    requests = [RouteRequest((1, 2, tail)) for tail in range(50)]
    assert len({two.rank(idle(), r)[0] for r in requests}) == 1


def test_different_prefixes_spread_roughly_evenly(policy: PrefixAffinityPolicy) -> None:
    counts = Counter(homes(policy, IDS, random_requests(4000)))
    assert set(counts) == set(IDS)
    assert all(600 < c < 1400 for c in counts.values()), counts  # 1000 each ± 40%


def test_no_full_block_goes_to_the_least_loaded(policy: PrefixAffinityPolicy) -> None:
    assert policy.rank(idle(r0=3, r1=1, r2=0, r3=1), RouteRequest(())) == ["r2", "r1", "r3", "r0"]


def test_bounded_load_spills_to_the_next_on_the_ring_and_returns(
    policy: PrefixAffinityPolicy, request_: RouteRequest
) -> None:
    walk = policy.rank(idle(), request_)
    home, nxt = walk[0], walk[1]
    others = {i: 4 for i in IDS if i != home}
    # Bound = 1.25 × (12 + L) / 4 + 1: L = 6 is within it (6 ≤ 6.625), L = 7 is not (7 > 6.94).
    assert policy.rank(idle(**others, **{home: 6}), request_)[0] == home
    assert policy.spillovers == 0
    spilled = policy.rank(idle(**others, **{home: 7}), request_)
    assert spilled == [*walk[1:], home]  # walk order, the over-bound replica last
    assert spilled[0] == nxt
    assert policy.spillovers == 1
    assert policy.rank(idle(**others, **{home: 6}), request_)[0] == home


def test_spill_skips_every_replica_over_the_bound(
    policy: PrefixAffinityPolicy, request_: RouteRequest
) -> None:
    walk = policy.rank(idle(), request_)
    # Mean 5, bound 7.25: the first two on the walk are over it.
    loads = {walk[0]: 10, walk[1]: 10, walk[2]: 0, walk[3]: 0}
    assert policy.rank(idle(**loads), request_) == [walk[2], walk[3], walk[0], walk[1]]


def test_load_includes_the_replicas_reported_queue(
    policy: PrefixAffinityPolicy, request_: RouteRequest
) -> None:
    walk = policy.rank(idle(), request_)
    replicas = [
        ReplicaView(
            i, in_flight=0, running=8 if i == walk[0] else 0, waiting=4 if i == walk[0] else 0
        )
        for i in IDS
    ]
    assert policy.rank(replicas, request_)[0] == walk[1]


def test_excluded_replica_is_never_chosen_and_the_next_applies(
    policy: PrefixAffinityPolicy, request_: RouteRequest
) -> None:
    walk = policy.rank(idle(), request_)
    replicas = [ReplicaView(i, in_flight=0, excluded=i == walk[0]) for i in IDS]
    assert policy.rank(replicas, request_) == walk[1:]
    # Other keys do not move while a breaker is open: the ring still holds the excluded replica.
    requests = random_requests(300, seed=1)
    before = homes(policy, IDS, requests)
    after = [policy.rank(replicas, r)[0] for r in requests]
    assert all(a == b for a, b in zip(after, before, strict=True) if b != walk[0])


def test_nothing_eligible_gives_an_empty_ranking(
    policy: PrefixAffinityPolicy, request_: RouteRequest
) -> None:
    assert policy.rank([], request_) == []
    assert policy.rank([ReplicaView("r0", in_flight=0, excluded=True)], request_) == []


def test_ring_is_stable_when_a_replica_leaves(policy: PrefixAffinityPolicy) -> None:
    ids = ("r0", "r1", "r2", "r3", "r4")
    requests = random_requests(3000, seed=2)
    before = homes(policy, ids, requests)
    after = homes(policy, tuple(i for i in ids if i != "r2"), requests)
    moved = [b for a, b in zip(after, before, strict=True) if a != b]
    assert set(moved) == {"r2"}  # only the leaver's keys move
    assert len(moved) / len(requests) < 1 / len(ids) + 0.05
    assert homes(policy, ids, requests) == before  # and come back when it returns


def test_ring_is_stable_when_a_replica_joins(policy: PrefixAffinityPolicy) -> None:
    requests = random_requests(3000, seed=3)
    before = homes(policy, IDS, requests)
    after = homes(policy, (*IDS, "r4"), requests)
    moved_to = [a for a, b in zip(after, before, strict=True) if a != b]
    assert set(moved_to) == {"r4"}  # keys move only onto the newcomer
    assert len(moved_to) / len(requests) < 1 / 5 + 0.05


def test_on_replicas_changed_prebuilds_the_same_ring(
    policy: PrefixAffinityPolicy, request_: RouteRequest
) -> None:
    expected = PrefixAffinityPolicy().rank(idle(), request_)
    policy.on_replicas_changed(list(IDS))
    assert policy.rank(idle(), request_) == expected


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prefix_blocks": 0}, "prefix_blocks"),
        ({"vnodes": 0}, "vnodes"),
        ({"load_factor": 0.9}, "load_factor"),
    ],
)
def test_rejects_bad_parameters(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        PrefixAffinityPolicy(**kwargs)
