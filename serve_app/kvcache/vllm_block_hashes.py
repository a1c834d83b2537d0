"""vLLM's own prefix-cache block hashes, computed without vLLM: what a vLLM replica announces.

A router that routes on a vLLM pool's KV events must name a prompt's blocks exactly as the
replicas' vLLM does, or its index lookups never meet the replicas' announcements. This module
reimplements vLLM 0.32's ``hash_block_tokens`` (``vllm/v1/core/kv_cache_utils.py``):

- block ``i``'s hash is ``hash_fn((parent, tuple(block_token_ids), extra_keys))``, its parent
  the previous block's hash (raw digest bytes), the first block's parent ``NONE_HASH``;
- ``NONE_HASH = hash_fn(seed)``, the seed ``PYTHONHASHSEED`` if the engine's process has it set,
  else ``"vllm-none-hash"`` for the cryptographic algorithms (the non-cryptographic ones, xxhash,
  draw a random seed per process: no router can follow them without a pinned seed);
- ``hash_fn`` is the engine's ``prefix_caching_hash_algo``: ``sha256`` (vLLM's default: SHA-256
  of the tuple's pickle, protocol 5, which Python's ``pickle`` writes identically for these
  types) or ``sha256_cbor`` (canonical CBOR, needs ``cbor2``);
- ``extra_keys`` is None or a tuple: a LoRA request's ``("lora", name, path)`` on every block,
  then a cache salt's ``("cache_salt", salt)`` on the first block only;
- the KV events announce each block by the digest's low 64 bits as an unsigned int (big-endian
  over the digest, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, on by default): that is what
  ``external_hash`` gives and what the index holds.

Multimodal inputs and prompt embeddings add keys from the engine's processed inputs, which a
router cannot see: such requests are hashed as plain text and simply miss the index.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"  # vLLM's, when PYTHONHASHSEED is not set
_INT_MASK = (1 << 64) - 1


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    import cbor2  # only for a pool that sets prefix_caching_hash_algo: sha256_cbor

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256,
    "sha256_cbor": _sha256_cbor,
}


def external_hash(digest: bytes | int) -> int:
    """A block's name in vLLM's KV events: the digest's low 64 bits (an int passes through)."""
    if isinstance(digest, int):
        return digest
    return int.from_bytes(digest, "big") & _INT_MASK


def lora_extra_key(lora_name: str, lora_path: str) -> tuple[str, str, str]:
    """A LoRA request's key on each of its blocks: the name and path vLLM's ``LoRARequest``
    has (Forge serves an adapter as ``<model>:<adapter>``, from the pool's adapter path)."""
    return ("lora", lora_name, lora_path)


class VllmBlockHasher:
    """vLLM's block-hash chain for one pool's engine settings (see the module docstring).

    ``seed``: the engine process's ``PYTHONHASHSEED``, None when it is not set.
    """

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in _HASH_FUNCTIONS:
            raise ValueError(
                f"prefix_caching_hash_algo {algo!r} cannot be followed by the router: "
                f"use one of {sorted(_HASH_FUNCTIONS)} (xxhash seeds itself per process)"
            )
        self.algo = algo
        self._hash = _HASH_FUNCTIONS[algo]
        self.seed = DEFAULT_NONE_HASH_SEED if seed is None else seed
        self.none_hash = self._hash(self.seed)

    @classmethod
    def from_environment(cls, algo: str = "sha256") -> VllmBlockHasher:
        """The hasher of an engine started in this process's environment."""
        return cls(algo, os.environ.get("PYTHONHASHSEED"))

    def block_digests(
        self,
        token_ids: Sequence[int],
        block_size: int,
        lora: tuple[str, str, str] | None = None,
        cache_salt: str | None = None,
    ) -> list[bytes]:
        """The raw digests of the prompt's full blocks (the partial last block is not hashed)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        digests: list[bytes] = []
        parent = self.none_hash
        rest_keys = (lora,) if lora is not None else None
        first_keys = tuple(k for k in (lora, ("cache_salt", cache_salt)) if k and k[-1]) or None
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            keys = first_keys if start == 0 else rest_keys
            parent = self._hash((parent, tuple(token_ids[start : start + block_size]), keys))
            digests.append(parent)
        return digests

    def block_hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        lora: tuple[str, str, str] | None = None,
        cache_salt: str | None = None,
    ) -> tuple[int, ...]:
        """The prompt's blocks as vLLM's KV events name them."""
        return tuple(
            external_hash(d) for d in self.block_digests(token_ids, block_size, lora, cache_salt)
        )
