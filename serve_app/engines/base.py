"""The narrow protocol between a replica and the engine it runs.

A replica is engine-agnostic: it handles fault injection, coalescing and the Serve plumbing,
and asks its engine for OpenAI-shaped output. The engine speaks OpenAI at this boundary (like
vLLM's own serving layer does) so the vLLM engine can reuse vLLM's chat templates, tokenizer and
output formatting unchanged, and the simulated engine is a faithful stand-in for it.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Literal

Kind = Literal["chat", "completion", "embedding"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage of one request; always the engine's own count."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # Of the completion tokens, the model's reasoning: what vLLM reports where a reasoning
    # parser is configured (None: no parser, and no ``completion_tokens_details``).
    reasoning_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_openai(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            **(
                {"completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}
                if self.reasoning_tokens is not None
                else {}
            ),
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
    prompt_tokens: int = 0  # cumulative, as vllm:prompt_tokens_total
    # LoRA, as vllm:lora_requests_info says it (max_lora, running and waiting adapters, here
    # with their request counts), plus the adapters loaded now (least recently used first)
    # and how many loads there were: what adapter-aware routing reads (``routing/adapters.py``).
    max_loras: int = 0
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    lora_adapters: list[str] = field(default_factory=list)
    lora_loads: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class AbandonedUsage:
    """What generations their callers abandoned cost, kept briefly for the gateway to collect.

    A stream the client leaves is aborted at once (its slot is freed), so its usage cannot
    travel in the stream; the gateway asks for it right after (``Replica.abandoned_usage``) and
    charges the tenant exactly what the engine produced. Entries nobody collects (a caller that
    died too) go after ``ttl_s`` or when more than ``keep`` wait. Keyed by the gateway's request
    id: two abandoned requests under one client-chosen id on one replica are told apart only
    by order.
    """

    def __init__(self, keep: int = 4096, ttl_s: float = 120.0) -> None:
        self.keep = keep
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, list[tuple[float, Usage]]] = OrderedDict()
        self._arrived: dict[str, asyncio.Event] = {}

    def record(self, request_id: str, usage: Usage) -> None:
        now = time.monotonic()
        self._entries.setdefault(request_id, []).append((now, usage))
        self._entries.move_to_end(request_id)
        while len(self._entries) > self.keep or (
            self._entries and next(iter(self._entries.values()))[0][0] < now - self.ttl_s
        ):
            self._entries.popitem(last=False)
        event = self._arrived.pop(request_id, None)
        if event is not None:
            event.set()

    async def collect(self, request_id: str, wait_s: float) -> Usage | None:
        """The usage of an abandoned request (once), waiting up to ``wait_s`` for the abort to
        land; None if it never does (the request finished, or was never here)."""
        if request_id not in self._entries:
            event = self._arrived.setdefault(request_id, asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), wait_s)
            except TimeoutError:
                return None
            finally:
                if self._arrived.get(request_id) is event:
                    del self._arrived[request_id]
        queued = self._entries.get(request_id)
        if not queued:
            return None
        _, usage = queued.pop(0)
        if not queued:
            del self._entries[request_id]
        return usage


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
        and frees its slot at once, and records what it cost in ``abandoned``.
        """

    @abstractmethod
    async def complete(self, body: dict, kind: Kind, request_id: str) -> tuple[dict, Usage]:
        """Serve a non-streaming request: the OpenAI response body and its usage. An
        ``embedding`` (only ever this way: embeddings do not stream) is served by an engine
        whose pool has ``task: embed``."""

    @abstractmethod
    def stats(self) -> EngineStats: ...

    # The longest prompt plus answer the model takes (vLLM's max_model_len), and the answer's
    # length for a request that names none: what ``truncation.py`` fits a conversation to.
    context_window: int
    default_max_tokens: int

    async def count_prompt(self, body: dict) -> int:
        """A chat body's prompt in tokens, as this engine counts it: its model's tokenizer and
        chat template, tools included."""
        raise NotImplementedError

    # Usage of aborted streams (see ``AbandonedUsage``); an engine records into it on abort.
    abandoned: AbandonedUsage

    def cached_block_hashes(self) -> list[int]:
        """Prefix-cache block hashes as the engine's KV events name them (the simulator: Forge's
        chain, ``serve_app/kvcache/block_hashes.py``; vLLM: its own): a KV event publisher's
        snapshot for a router that resyncs. Engines that cannot tell return nothing; routing
        then ignores cache state."""
        return []

    def block_hashing(self) -> dict | None:
        """How the engine names a prompt's blocks, for routers that compute the names
        themselves (``routing/prompt_hashing.py``): vLLM's hash algorithm, seed and block size.
        None: the pool's config says all there is (the simulator's chain)."""
        return None

    @abstractmethod
    async def check_health(self) -> None:
        """Raise if the engine cannot serve."""

    async def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources; in-flight requests have already been drained by the replica."""
