"""The narrow protocol between a replica and the engine it runs.

A replica is engine-agnostic: it handles fault injection, coalescing and the Serve plumbing,
and asks its engine for OpenAI-shaped output. The engine speaks OpenAI at this boundary (like
vLLM's own serving layer does) so the vLLM engine can reuse vLLM's chat templates, tokenizer and
output formatting unchanged, and the simulated engine is a faithful stand-in for it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Literal

Kind = Literal["chat", "completion"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage of one request; always the engine's own count."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_openai(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Load and cache state under vLLM's metric names, for routing and dashboards."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float  # 0.0 .. 1.0, as vllm:kv_cache_usage_perc
    prefix_cache_queries: int  # tokens queried, as vllm:prefix_cache_queries_total
    prefix_cache_hits: int  # tokens hit, as vllm:prefix_cache_hits_total
    max_num_seqs: int
    generation_tokens: int = 0  # cumulative, as vllm:generation_tokens_total

    def as_dict(self) -> dict:
        return asdict(self)


class EngineError(Exception):
    """The engine failed to serve a request (maps to a 5xx at the gateway)."""


class Engine(ABC):
    """What a replica needs from an engine."""

    @abstractmethod
    async def start(self) -> None:
        """Load the model / start background loops. Called once, inside the replica."""

    @abstractmethod
    def stream(self, body: dict, kind: Kind, request_id: str) -> AsyncIterator[bytes | Usage]:
        """Yield SSE frames (``b"data: {...}\\n\\n"``), then exactly one ``Usage`` as the last item.

        The usage frame is included among the SSE frames only when the client asked for it
        (``stream_options.include_usage``); the ``Usage`` item is always yielded, for metering.
        ``data: [DONE]`` is not the engine's to send. Cancelling the iterator aborts the request
        and frees its slot at once.
        """

    @abstractmethod
    async def complete(self, body: dict, kind: Kind, request_id: str) -> tuple[dict, Usage]:
        """Serve a non-streaming request: the OpenAI response body and its usage."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    def cached_block_hashes(self) -> list[int]:
        """Prefix-cache block hashes (vLLM's chain over full prompt blocks), for KV-aware
        routing. Engines that cannot tell return nothing; routing then ignores cache state."""
        return []

    @abstractmethod
    async def check_health(self) -> None:
        """Raise if the engine cannot serve."""

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources; in-flight requests have already been drained by the replica."""
