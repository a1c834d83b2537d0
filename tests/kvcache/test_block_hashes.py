"""The prompt's block hash chain: what the routers and the engines name cached blocks by."""

from __future__ import annotations

import pytest

from serve_app.engines import simulated_llm
from serve_app.kvcache.block_hashes import prefix_block_hashes

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
