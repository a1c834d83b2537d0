"""vLLM's block hashes, reimplemented for the router, against vectors vLLM 0.32 computed.

The vectors came from vLLM's own ``hash_block_tokens`` and ``maybe_convert_block_hash``
(``vllm/v1/core/kv_cache_utils.py``, sha256 with the default seed, events' int hashes) over
token ids 100..163 in blocks of 16; ``tests/vllm/test_prompt_hashes_vllm.py`` checks the same
against a running engine's announcements.
"""

from __future__ import annotations

import pytest

from serve_app.kvcache.vllm_block_hashes import (
    VllmBlockHasher,
    external_hash,
    lora_extra_key,
)

IDS = list(range(100, 170))  # 4 full blocks of 16 and a partial one, never hashed

PLAIN = (15126711022707342677, 3356471519746799895)
LORA = (16472408622108584904, 4731390578707120968)
SALTED = (5716110328575560957, 6495371342055410870)
LORA_SALTED = (5234957906066619394, 14070096378084359963)


def test_plain_blocks_match_vllms():
    hashes = VllmBlockHasher().block_hashes(IDS, 16)

    assert len(hashes) == 4
    assert hashes[:2] == PLAIN


def test_a_loras_blocks_are_keyed_by_its_name_and_path_on_every_block():
    lora = lora_extra_key("forge-tiny:a", "/p/a")

    hashes = VllmBlockHasher().block_hashes(IDS, 16, lora)

    assert hashes[:2] == LORA
    assert not set(hashes) & set(VllmBlockHasher().block_hashes(IDS, 16))


def test_a_cache_salt_keys_the_first_block_and_so_the_whole_chain():
    assert VllmBlockHasher().block_hashes(IDS, 16, cache_salt="s1")[:2] == SALTED
    lora = lora_extra_key("m:x", "/q")
    assert VllmBlockHasher().block_hashes(IDS, 16, lora, "s2")[:2] == LORA_SALTED


def test_the_seed_is_pythonhashseed_when_the_engine_has_it(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    seeded = VllmBlockHasher.from_environment().block_hashes(IDS, 16)
    assert seeded == VllmBlockHasher("sha256", "0").block_hashes(IDS, 16)
    assert seeded[:2] != PLAIN

    monkeypatch.delenv("PYTHONHASHSEED")
    assert VllmBlockHasher.from_environment().block_hashes(IDS, 16)[:2] == PLAIN


def test_a_block_commits_to_its_parents():
    other = [*IDS[:16], 7, *IDS[17:]]  # the second block differs, the first does not

    ours, theirs = (
        VllmBlockHasher().block_hashes(IDS, 16),
        VllmBlockHasher().block_hashes(other, 16),
    )

    assert ours[0] == theirs[0]
    assert all(a != b for a, b in zip(ours[1:], theirs[1:], strict=True))


def test_events_name_a_digest_by_its_low_64_bits():
    digest = VllmBlockHasher().block_digests(IDS, 16)[0]

    assert len(digest) == 32
    assert external_hash(digest) == PLAIN[0] == int.from_bytes(digest[-8:], "big")
    assert external_hash(PLAIN[0]) == PLAIN[0]


def test_an_algorithm_the_router_cannot_follow_is_refused():
    with pytest.raises(ValueError, match="xxhash"):
        VllmBlockHasher("xxhash")
