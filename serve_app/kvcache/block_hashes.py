"""The prompt's block-hash chain: the one key the routers and the engines' prefix caches share.

Neutral ground on purpose: the engines compute it to name the blocks they cache, the routers to
name the blocks a prompt needs; neither imports the other.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Parent-chained hashes of the prompt's full blocks; the partial last block is not hashed.

    Block ``i``'s hash commits to every token up to the end of block ``i`` (each digest includes
    its parent's), as vLLM's and the simulated engine's prefix caches do. It is a blake2b digest
    of the token ids as little-endian int64, so it is the same in every process: the gateway and
    the replicas must agree on it, and builtin ``hash`` does not (``hash(None)``, which seeds the
    chain in ``serve_app.engines.simulated_llm._block_hashes``, is an address on Python < 3.12).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_block_hash(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return tuple(hashes)


def chain_block_hash(parent: int | None, block_token_ids: Sequence[int]) -> int:
    """One link of the chain: the hash of a block given its parent's (None for the first).

    Exposed for whoever learns blocks one at a time, as the vLLM engine does from vLLM's own
    KV-cache events (which name blocks by vLLM's hashes and carry their token ids).
    """
    ids = array("q", block_token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    prefix = b"" if parent is None else parent.to_bytes(8, "little")
    return int.from_bytes(hashlib.blake2b(prefix + ids.tobytes(), digest_size=8).digest(), "little")
