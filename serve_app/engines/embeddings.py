"""The simulated engine's embeddings: deterministic unit vectors, shaped as vLLM returns them.

A vector is the normalised sum of one fixed pseudo-random direction per token (a bag of
tokens), so the same input always embeds the same, in every process, and inputs that share
tokens are closer than inputs that share none: enough for a retrieval demo or a test to rank
neighbours predictably, without weights. ``dimensions`` keeps the first components and
renormalises (matryoshka style, as OpenAI's ``text-embedding-3`` models do);
``encoding_format: base64`` packs little-endian float32, which the official clients ask for by
default.
"""

from __future__ import annotations

import base64
import functools
import time
from collections.abc import Sequence

import numpy as np

from serve_app import errors


# One direction per token seen lately: ~3 kB each at 384 dimensions, so at most ~25 MB (the
# soak showed an unbounded-looking climb at 65,536 entries, ~200 MB at 384).
@functools.lru_cache(maxsize=8192)
def _direction(token_id: int, dim: int) -> np.ndarray:
    return np.random.default_rng(token_id & 0xFFFFFFFFFFFFFFFF).standard_normal(dim)


def embed_tokens(token_ids: Sequence[int], dim: int) -> np.ndarray:
    """The unit vector of one input's tokens."""
    total = np.zeros(dim)
    for token in token_ids:
        total += _direction(token, dim)
    norm = np.linalg.norm(total)
    return total / norm if norm else total


def output_dimensions(body: dict, native: int) -> int:
    """The vector length asked for: ``dimensions`` when given (at most the model's own)."""
    asked = body.get("dimensions")
    if asked is None:
        return native
    if not isinstance(asked, int) or isinstance(asked, bool) or not 1 <= asked <= native:
        raise errors.invalid_request(
            f"'dimensions' must be an integer from 1 to {native} for this model.",
            param="dimensions",
        )
    return asked


def encode_vector(vector: np.ndarray, dimensions: int, encoding_format: str) -> list | str:
    """The first ``dimensions`` components, renormalised, as floats or base64 float32."""
    head = vector[:dimensions]
    norm = np.linalg.norm(head)
    head = head / norm if norm else head
    if encoding_format == "base64":
        return base64.b64encode(head.astype("<f4").tobytes()).decode()
    return [float(x) for x in head.astype(np.float32)]


def embedding_response(request_id: str, model: str, data: list, prompt_tokens: int) -> dict:
    """vLLM's (and OpenAI's) embeddings envelope."""
    return {
        "id": "embd-" + request_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": i, "object": "embedding", "embedding": e} for i, e in enumerate(data)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
        },
    }
