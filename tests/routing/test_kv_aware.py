"""KV-aware: the least prefill to wait for (queued plus its own), under a load guard."""

from __future__ import annotations

import pytest

from serve_app.routing import KvAwarePolicy, ReplicaView, RouteRequest, matched_prefix_blocks
from serve_app.routing.kv_aware import uncached_tokens

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


def test_score_trades_uncached_tokens_against_queued_prefill() -> None:
    # 8 blocks of 16 tokens. b holds 6 (32 tokens to prefill), a holds 2 (96 tokens).
    def first(b_backlog: int) -> str:
        replicas = [
            replica("a", BLOCKS[:2]),
            ReplicaView(
                "b", in_flight=0, cached_blocks=frozenset(BLOCKS[:6]), backlog_tokens=b_backlog
            ),
        ]
        return KvAwarePolicy().rank(replicas, REQUEST)[0]

    assert first(50) == "b"  # 50 + 32 < 96: waiting there still pays
    assert first(200) == "a"  # 200 + 32 > 96: prefilling elsewhere is sooner


def test_a_prefix_spills_by_score_only_when_the_queue_costs_more_than_the_prefill() -> None:
    policy = KvAwarePolicy(request_cost_tokens=64)

    def first(hot_requests: int) -> str:
        replicas = [
            replica("hot", BLOCKS, load=hot_requests),
            replica("warm", BLOCKS[:1], load=4),
            replica("cold", load=4),
        ]
        return policy.rank(replicas, REQUEST)[0]

    # hot: 64 × L (nothing to prefill); warm: 64 × 4 + 112; cold: 64 × 4 + 128.
    assert first(5) == "hot"  # 320 < 368
    assert first(6) == "warm"  # 384 > 368
    assert policy.spillovers == 0  # a choice by score, not the bound


def test_load_guard_spills_a_hot_prefix_and_returns() -> None:
    # A long prompt only "hot" holds: by score it would stay there up to 16 requests deep.
    blocks = tuple(range(1000, 1064))
    request = RouteRequest(blocks, prompt_tokens=64 * 16)
    policy = KvAwarePolicy(request_cost_tokens=64, load_factor=1.5)

    def rank(hot_requests: int) -> list[str]:
        replicas = [replica("hot", blocks, load=hot_requests), replica("b"), replica("c")]
        return policy.rank(replicas, request)

    # Bound on requests = 1.5 × L / 3 + 1: L = 2 is within it (2 ≤ 2), L = 3 is not (3 > 2.5).
    assert rank(2) == ["hot", "b", "c"]
    assert policy.spillovers == 0
    assert rank(3) == ["b", "c", "hot"]
    assert policy.spillovers == 1
    assert rank(2)[0] == "hot"


def test_a_token_bound_spills_on_queued_prefill_that_a_request_bound_lets_through() -> None:
    # "hot" holds the prompt, runs one request and has 40 uncached tokens queued.
    blocks = tuple(range(2000, 2008))
    request = RouteRequest(blocks, prompt_tokens=8 * 16)
    hot = ReplicaView("hot", in_flight=1, cached_blocks=frozenset(blocks), backlog_tokens=40)
    replicas = [hot, replica("b"), replica("c")]
    # Scores: hot 40 + 64 × 1 + 0 = 104; b and c 0 + 128 (the whole prompt).
    # Requests bound: 1 <= 1.5 × 1/3 + 1, so hot stays first.
    by_requests = KvAwarePolicy()
    assert by_requests.rank(replicas, request)[0] == "hot"
    assert by_requests.spillovers == 0
    # Tokens bound, factor 1: hot's load 104 > 1.0 × 104/3 + 64 (one request's cost) = 98.7.
    by_tokens = KvAwarePolicy(bound="tokens", load_factor=1.0)
    assert by_tokens.rank(replicas, request) == ["b", "c", "hot"]
    assert by_tokens.spillovers == 1


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
    assert KvAwarePolicy().rank([busy, idle], REQUEST) == ["idle", "busy"]


def test_uncached_tokens_is_what_the_request_adds_there() -> None:
    request = RouteRequest(BLOCKS, prompt_tokens=140)
    assert uncached_tokens(request, frozenset(BLOCKS[:3])) == 140 - 48
    assert uncached_tokens(request, frozenset(BLOCKS[1:])) == 140  # no leading run
    assert uncached_tokens(RouteRequest(BLOCKS), frozenset(BLOCKS)) == 0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"request_cost_tokens": -1}, "request_cost_tokens"),
        ({"load_factor": 0.5}, "load_factor"),
        ({"bound": "bytes"}, "bound"),
    ],
)
def test_rejects_bad_parameters(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KvAwarePolicy(**kwargs)
