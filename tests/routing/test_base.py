"""Shared routing pieces: the prompt's block hash chain, the load bound, the policy registry."""

from __future__ import annotations

import pytest

from serve_app.engines import simulated_llm
from serve_app.kvcache.block_hashes import prefix_block_hashes
from serve_app.routing import POLICY_NAMES, ReplicaView, build_policy
from serve_app.routing.base import bounded_load_order
from serve_app.routing.prefix_affinity import PrefixAffinityPolicy

# blake2b chain over int64 little-endian token ids; fixed values prove it is the same in every
# process and on every machine (builtin ``hash`` is not).
GOLDEN_0_TO_39_BS16 = (5753832455673805477, 8499945399178334316)


def test_block_hashes_are_stable_golden_values() -> None:
    assert prefix_block_hashes(list(range(40)), 16) == GOLDEN_0_TO_39_BS16


def test_only_full_blocks_are_hashed() -> None:
    assert prefix_block_hashes([], 16) == ()
    assert prefix_block_hashes(list(range(15)), 16) == ()
    assert len(prefix_block_hashes(list(range(32)), 16)) == 2
    assert prefix_block_hashes(list(range(47)), 16) == prefix_block_hashes(list(range(32)), 16)


def test_each_hash_commits_to_its_whole_prefix() -> None:
    tokens = list(range(64))
    base = prefix_block_hashes(tokens, 16)
    # A shared prefix gives shared leading hashes, then they part.
    other_tail = prefix_block_hashes(tokens[:32] + [999] * 32, 16)
    assert other_tail[:2] == base[:2]
    assert other_tail[2:] != base[2:]
    # A change in the first block changes every hash after it, even for identical later blocks.
    changed_head = prefix_block_hashes([7, *tokens[1:]], 16)
    assert all(a != b for a, b in zip(changed_head, base, strict=True))
    # Same block content at a different position is a different block.
    assert len(set(prefix_block_hashes([5] * 64, 16))) == 4


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        prefix_block_hashes([1, 2, 3], 0)


def test_block_hashes_match_the_simulated_engine() -> None:
    """The router's chain is the engine's: a KV index keyed by one finds the other's blocks."""
    tokens = list(range(1000, 1100))
    assert prefix_block_hashes(tokens, 16) == simulated_llm._block_hashes(tokens, 16)


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


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_registry_builds_every_policy_under_its_name(name: str) -> None:
    assert build_policy(name).name == name


def test_registry_passes_arguments() -> None:
    policy = build_policy("prefix_affinity", prefix_blocks=2, load_factor=1.5)
    assert isinstance(policy, PrefixAffinityPolicy)
    assert (policy.prefix_blocks, policy.load_factor) == (2, 1.5)


def test_registry_rejects_unknown_names_listing_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown routing policy 'fastest'.*round_robin.*kv_aware"
    ):
        build_policy("fastest")


def test_registry_rejects_unknown_arguments_naming_the_policy() -> None:
    with pytest.raises(ValueError, match=r"routing policy 'round_robin'.*vnodes"):
        build_policy("round_robin", vnodes=3)


def test_registry_surfaces_bad_values() -> None:
    with pytest.raises(ValueError, match="load_factor"):
        build_policy("kv_aware", load_factor=0.5)
