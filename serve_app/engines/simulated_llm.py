"""A token-level model of a vLLM engine core, in pure asyncio.

The gateway's scheduling, routing and failover only mean something if the replicas behind them
behave like vLLM under load: a bounded set of running sequences, a waiting queue, a paged KV
cache whose prefix cache makes repeated prompts cheap, and decode steps that slow down as the
batch grows. ``SimulatedLLM`` models exactly that, at token granularity, so a laptop or CI can
exercise those policies without a GPU. It knows nothing of Ray or of OpenAI formatting; the
simulated engine wraps it.

Deliberate simplifications, each noted where it lives:

- No preemption. vLLM admits optimistically and preempts when decode runs out of blocks; here a
  request is admitted only when its whole final footprint fits, which the simulator knows
  because it picks the output length itself. Blocks are still taken one at a time as decode
  proceeds, so ``kv_cache_usage`` rises with load as it does in vLLM.
- Only full prompt blocks are hashed into the prefix cache; the partial last prompt block and the
  decode blocks are private to the request and freed when it ends.
- A prompt's blocks enter the prefix cache when the request is admitted, as vLLM caches a
  chunk's blocks when it schedules the chunk: a request admitted a step later hits them.

Chunked prefill, as vLLM's scheduler does by default: each step has a budget of
``max_num_batched_tokens``; running decodes take one token each, then prefills under way take
chunks in admission order, then waiting requests are admitted while budget, slots and blocks
last. A request's first token comes at the end of the step that computes its last chunk.

LoRA adapters, as vLLM's scheduler and LRU adapter cache treat them: at most ``max_loras``
adapters are resident; a waiting request whose adapter is not resident takes a free slot or
the least recently used adapter no running request uses, and the step that loads it costs
``adapter_load_s`` more; when every slot is in use it is skipped (the requests behind it may
go first, as vLLM skips it). An adapter changes the output (its name seeds the tokens) and the
prefix cache's keys (vLLM hashes a block with its request's LoRA name), never the timing.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, fields
from typing import Literal

from serve_app.engines.base import EngineError, Usage
from serve_app.kvcache.block_hashes import prefix_block_hashes
from serve_app.kvcache.events import EngineLoad, KvEventPublisher
from serve_app.tokenizer import OUTPUT_WORDS, token_id

FinishReason = Literal["stop", "length"]

_MASK64 = (1 << 64) - 1
# Precomputed so the hot loop never hashes a piece to find its id.
_OUTPUT_IDS: tuple[int, ...] = tuple(token_id(w) for w in OUTPUT_WORDS)


@dataclass(frozen=True)
class SimulatedLLMConfig:
    """Capacity and cost model of one simulated replica; times are seconds."""

    max_num_seqs: int = 8
    block_size: int = 16
    num_kv_blocks: int = 4096
    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 0.0
    decode_base_s: float = 0.0
    decode_per_seq_s: float = 0.0
    output_tokens_min: int = 16
    output_tokens_max: int = 64
    # Tokens computed per step (decodes count one each); vLLM's default for its API server.
    max_num_batched_tokens: int = 2048
    # Resident LoRA adapters (vLLM's max_loras) and what loading one adds to its step.
    max_loras: int = 4
    adapter_load_s: float = 0.0

    def __post_init__(self) -> None:
        # Fail at construction, naming the field, rather than deadlock or divide by zero later.
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s"):
                if value < 0:
                    raise ValueError(f"{f.name} must be >= 0, got {value}")
            elif value < 1:
                raise ValueError(f"{f.name} must be >= 1, got {value}")
        if self.output_tokens_max < self.output_tokens_min:
            raise ValueError(
                f"output_tokens_max ({self.output_tokens_max}) must be >= "
                f"output_tokens_min ({self.output_tokens_min})"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # As vLLM requires: a full batch of decodes must fit one step.
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )


@dataclass(frozen=True, slots=True)
class TokenOutput:
    """The tokens generated for a request since its consumer last took an output, as the engine
    hands them to the formatting layer: one token while the consumer keeps up, several merged
    into one output for a consumer that fell behind (``_Request.take``)."""

    token_ids: tuple[int, ...]
    text: str
    index: int  # of the first of these tokens in the generation
    finish_reason: FinishReason | None
    num_cached_tokens: int
    pieces: tuple[str, ...] = ()  # each token's text: ``text`` is them joined

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _mix64(x: int) -> int:
    """SplitMix64 finaliser: a stable, well-spread hash of a 64-bit counter."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _output_seed(
    prompt_token_ids: Sequence[int], seed_text: str | None, adapter: str | None = None
) -> int:
    """Digest of the prompt (and seed text, and adapter): the same in every process, unlike
    ``hash``. An adapter's answer to a prompt is its own, as a fine-tune's is."""
    ids = array("q", prompt_token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    digest = hashlib.blake2b(ids.tobytes(), digest_size=8)
    if seed_text is not None:
        digest.update(b"\x00" + seed_text.encode())
    if adapter is not None:
        digest.update(b"\x01" + adapter.encode())
    return int.from_bytes(digest.digest(), "little")


def _adapter_salted(hashes: tuple[int, ...], adapter: str | None) -> tuple[int, ...]:
    """Block hashes of a request served by ``adapter``: vLLM adds the LoRA name to every
    block's hash, so an adapter's cached prefix is never the base model's (or another's)."""
    if adapter is None:
        return hashes
    salt = int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8).digest(), "little")
    return tuple(_mix64(h ^ salt) for h in hashes)


def _block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """vLLM's hash chain over the full blocks of a prompt: each hash commits to its prefix.

    The same function the gateway's routers use, so the blocks a replica reports as cached are
    the blocks a router computes for a prompt (``hash()`` would differ between processes).
    """
    return prefix_block_hashes(prompt_token_ids, block_size)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _KVBlockPool:
    """Paged KV cache with a prefix cache sharing the same blocks, as in vLLM.

    A block is free, held privately by one running request (``anonymous``), or cached under its
    hash: pinned while any running request refers to it, evictable (LRU) when none does. Running
    requests also hold a reservation for the blocks their remaining decode will take, so growth
    never fails and nothing needs preempting.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.events: KvEventPublisher | None = None  # told of every block cached and evicted
        self._refs: dict[int, int] = {}  # hash -> running requests using it (0 = evictable)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._num_anonymous = 0
        self._num_reserved = 0

    @property
    def num_free(self) -> int:
        return self.num_blocks - len(self._refs) - self._num_anonymous

    @property
    def num_pinned(self) -> int:
        return len(self._refs) - len(self._evictable) + self._num_anonymous

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._refs

    def try_admit(
        self, hashes: tuple[int, ...], num_anonymous_now: int, num_final_blocks: int
    ) -> bool:
        """Pin/allocate a prompt's blocks and reserve the rest, or change nothing and say no."""
        refs, evictable = self._refs, self._evictable
        shared = shared_evictable = 0
        for h in hashes:
            if h in refs:
                shared += 1
                if h in evictable:
                    shared_evictable += 1
        available = self.num_free + len(evictable) - shared_evictable - self._num_reserved
        if num_final_blocks - shared > available:
            return False
        # Pin the shared blocks before allocating, so allocation cannot evict one of them.
        for h in hashes:
            count = refs.get(h)
            if count is not None:
                if count == 0:
                    del evictable[h]
                refs[h] = count + 1
        stored = []
        for h in hashes:
            if h not in refs:
                self._make_room()
                refs[h] = 1
                stored.append(h)
        if stored and self.events is not None:
            self.events.stored(stored)
        self.take_anonymous(num_anonymous_now)
        self._num_reserved += num_final_blocks - len(hashes) - num_anonymous_now
        return True

    def take_anonymous(self, n: int) -> None:
        for _ in range(n):
            self._make_room()
            self._num_anonymous += 1

    def grow(self) -> None:
        """Turn one reserved block into a held one (a decode step crossed a block boundary)."""
        self._make_room()
        self._num_anonymous += 1
        self._num_reserved -= 1

    def release(self, hashes: tuple[int, ...], num_anonymous: int, num_reserved: int) -> None:
        self._num_anonymous -= num_anonymous
        self._num_reserved -= num_reserved
        refs, evictable = self._refs, self._evictable
        # Tail blocks first, so LRU evicts a prompt's tail before its (more shareable) head.
        for h in reversed(hashes):
            count = refs[h] - 1
            refs[h] = count
            if count == 0:
                evictable[h] = None

    def _make_room(self) -> None:
        """Ensure one free block, evicting the least recently used cached block if needed."""
        if self.num_free > 0:
            return
        block_hash, _ = self._evictable.popitem(last=False)
        del self._refs[block_hash]
        if self.events is not None:
            self.events.removed((block_hash,))

    def matched_blocks(self, hashes: tuple[int, ...], limit: int) -> int:
        """How many of the first ``limit`` hashes are cached, as a leading run."""
        matched = 0
        for h in hashes[:limit]:
            if h not in self._refs:
                break
            matched += 1
        return matched


_WAITING, _RUNNING, _DONE = 0, 1, 2


class _Request:
    """Engine-side state of one request; the consumer ``take``s what is pending, woken by
    ``waiter``.

    What the consumer has not taken yet is one output that grows, never a queue of outputs:
    vLLM's ``AsyncLLM`` hands a request's outputs over through a one-slot
    ``RequestOutputCollector`` that merges a new delta output into the one not yet taken
    (``RequestOutput.add``), so its engine never waits for a slow consumer: it keeps generating,
    and the consumer gets fewer, longer outputs. A slow reader therefore costs the engine the
    undelivered tokens (an id and a shared word each here), not an object per token.
    """

    __slots__ = (
        "adapter",
        "block_hashes",
        "last_finish_reason",
        "num_anonymous_blocks",
        "num_cached_tokens",
        "num_final_blocks",
        "num_generated",
        "num_output_tokens",
        "num_prompt_tokens",
        "on_abort",
        "pending_finish",
        "pending_ids",
        "pending_index",
        "pending_text",
        "pooling",
        "prefill_left",
        "request_id",
        "seed",
        "state",
        "waiter",
    )

    def __init__(
        self,
        request_id: str,
        num_prompt_tokens: int,
        block_hashes: tuple[int, ...],
        seed: int,
        num_output_tokens: int,
        last_finish_reason: FinishReason,
        num_final_blocks: int,
        on_abort: Callable[[Usage], None] | None = None,
        pooling: bool = False,
        adapter: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.adapter = adapter
        self.pooling = pooling
        self.on_abort = on_abort
        self.num_prompt_tokens = num_prompt_tokens
        self.block_hashes = block_hashes
        self.seed = seed
        self.num_output_tokens = num_output_tokens
        self.last_finish_reason = last_finish_reason
        self.num_final_blocks = num_final_blocks
        self.num_anonymous_blocks = 0
        self.num_cached_tokens = 0
        self.num_generated = 0
        self.prefill_left = 0  # uncached prompt tokens not yet computed (while running)
        self.state = _WAITING
        self.pending_ids: list[int] = []  # generated, not yet taken by the consumer
        self.pending_text: list[str] = []
        self.pending_index = 0
        self.pending_finish: FinishReason | None = None
        self.waiter: asyncio.Future[None] | None = None

    def add(self, token_id: int, text: str, index: int, finish: FinishReason | None) -> None:
        if not self.pending_ids:
            self.pending_index = index
        self.pending_ids.append(token_id)
        self.pending_text.append(text)
        self.pending_finish = finish

    def take(self) -> TokenOutput | None:
        """Everything generated since the last take, as one output (None if nothing is)."""
        if not self.pending_ids:
            return None
        output = TokenOutput(
            token_ids=tuple(self.pending_ids),
            text="".join(self.pending_text),
            index=self.pending_index,
            finish_reason=self.pending_finish,
            num_cached_tokens=self.num_cached_tokens,
            pieces=tuple(self.pending_text),
        )
        self.pending_ids, self.pending_text, self.pending_finish = [], [], None
        return output

    def drop_pending(self) -> None:
        self.pending_ids, self.pending_text, self.pending_finish = [], [], None

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _cost(request: _Request, prefilled: bool) -> Usage:
    """What a request cost the engine: its prompt if it was prefilled, and every token
    generated for it, delivered or not (what the engine's counters added)."""
    return Usage(
        request.num_prompt_tokens if prefilled else 0,
        request.num_generated,
        request.num_cached_tokens if prefilled else 0,
    )


def _prefill_chunk(request: _Request, budget: int, emitting: list[_Request]) -> int:
    """Give the request a chunk of the step's budget; returns what is left of the budget.
    A request whose prefill this chunk finishes gets its first token at the end of the step."""
    chunk = min(request.prefill_left, budget)
    request.prefill_left -= chunk
    if request.prefill_left == 0:
        emitting.append(request)
    return budget - chunk


class SimulatedLLM:
    """Continuous batching over a paged, prefix-cached KV store, stepping like vLLM's core.

    One background loop runs steps. A step schedules work within its token budget (decodes,
    then chunks of prefills under way, then waiting requests admitted FIFO while a slot, blocks
    and budget remain), sleeps for the step's simulated cost, then gives a token to every
    request that was decoding and to every request whose prefill this step finished. TTFT is
    therefore queueing plus the steps its uncached tokens take, each step as long as the work
    it batches.

    ``events``: when set (the replica's KV event publisher), every block cached or evicted,
    every request taken in, and the queued prefill work are published as they change.
    """

    def __init__(self, config: SimulatedLLMConfig, *, slow_factor: float = 1.0) -> None:
        self._config = config
        self.slow_factor = slow_factor
        self._pool = _KVBlockPool(config.num_kv_blocks)
        self._requests: dict[str, _Request] = {}
        self._waiting: OrderedDict[str, _Request] = OrderedDict()
        self._running: dict[str, _Request] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._failure: BaseException | None = None
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self._generation_tokens = 0
        self._steps = 0  # for tests: proves the loop idles instead of spinning
        # LoRA: resident adapters, least recently used first; running requests per adapter.
        self._adapters: OrderedDict[str, None] = OrderedDict()
        self._adapter_running: dict[str, int] = {}
        self._adapter_loads = 0  # cumulative
        self._step_loads = 0  # adapters the step being scheduled loads
        self._events: KvEventPublisher | None = None
        self._emitting: list[_Request] = []  # this step's token receivers (``_schedule``)

    @property
    def events(self) -> KvEventPublisher | None:
        return self._events

    @events.setter
    def events(self, publisher: KvEventPublisher | None) -> None:
        self._events = self._pool.events = publisher

    @property
    def config(self) -> SimulatedLLMConfig:
        return self._config

    @property
    def slow_factor(self) -> float:
        """Multiplies every simulated delay; settable at run time (failure injection)."""
        return self._slow_factor

    @slow_factor.setter
    def slow_factor(self, value: float) -> None:
        if value < 0:
            raise ValueError(f"slow_factor must be >= 0, got {value}")
        self._slow_factor = float(value)

    @property
    def num_requests_running(self) -> int:
        return len(self._running)

    @property
    def num_requests_waiting(self) -> int:
        return len(self._waiting)

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache, cumulative (vLLM counts tokens)."""
        return self._prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found in the prefix cache, cumulative."""
        return self._prefix_cache_hits

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the requests admitted (prefilled), cumulative, as
        vllm:prompt_tokens_total: a request aborted while still waiting adds nothing."""
        return self._prefix_cache_queries

    @property
    def generation_tokens(self) -> int:
        """Tokens generated, cumulative (vllm:generation_tokens_total): an aborted request
        stops adding to it at once."""
        return self._generation_tokens

    @property
    def adapter_loads(self) -> int:
        """Adapters loaded into a slot, cumulative (each costs ``adapter_load_s``)."""
        return self._adapter_loads

    def resident_adapters(self) -> list[str]:
        """The adapters loaded now, least recently used first."""
        return list(self._adapters)

    def running_adapters(self) -> dict[str, int]:
        """Running requests per adapter (vllm:lora_requests_info's running_lora_adapters)."""
        return {a: n for a, n in self._adapter_running.items() if n}

    def waiting_adapters(self) -> dict[str, int]:
        """Waiting requests per adapter (vllm:lora_requests_info's waiting_lora_adapters)."""
        waiting: dict[str, int] = {}
        for request in self._waiting.values():
            if request.adapter is not None:
                waiting[request.adapter] = waiting.get(request.adapter, 0) + 1
        return waiting

    def cached_block_hashes(self) -> list[int]:
        """Hashes of the prompt blocks in the prefix cache (in use or evictable): what a
        KV-aware router needs to know which replica already holds a prefix."""
        return list(self._pool._refs)

    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by running requests; evictable cached blocks count as free."""
        return self._pool.num_pinned / self._pool.num_blocks

    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        *,
        seed_text: str | None = None,
        ignore_eos: bool = False,
        on_abort: Callable[[Usage], None] | None = None,
        pooling: bool = False,
        adapter: str | None = None,
    ) -> AsyncIterator[TokenOutput]:
        """Validate now, return a stream of tokens that queues the request when first iterated.

        A plain method rather than an async generator so a request that can never be served
        fails here, at call time. The request enters the queue only when iteration starts, so a
        stream that is created but never iterated holds nothing. Each output is the tokens
        generated since the consumer took the last one (one, unless it fell behind: the engine
        does not wait for it). The stream ends after the output whose ``finish_reason`` is set,
        or, if aborted, early and without one. Closing it or
        cancelling its consumer aborts the request at once, and ``on_abort`` hears what the
        aborted request cost: its prompt if it was prefilled, and every token generated for
        it (delivered or not), exactly what the engine's counters added.

        ``adapter``: the LoRA adapter that serves it (the module docstring says how).

        ``pooling``: an embedding, as vLLM's pooling runner serves one: a slot and KV blocks for
        the prefill, then one output (the pooled state, here a token) that is no generated token.
        """
        cfg = self._config
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        worst_blocks = _ceil_div(num_prompt + max_tokens, cfg.block_size)
        if worst_blocks > cfg.num_kv_blocks:
            raise ValueError(
                f"request needs up to {worst_blocks} KV blocks ({num_prompt} prompt tokens + "
                f"max_tokens {max_tokens}, block_size {cfg.block_size}) but the cache has only "
                f"{cfg.num_kv_blocks}; shorten the prompt or lower max_tokens"
            )
        seed = _output_seed(prompt_token_ids, seed_text, adapter)
        span = cfg.output_tokens_max - cfg.output_tokens_min + 1
        # ignore_eos (a vLLM sampling parameter): the model never stops on its own.
        if ignore_eos or pooling:
            natural = max_tokens
        else:
            natural = cfg.output_tokens_min + _mix64(seed) % span
        num_output = min(max_tokens, natural)
        request = _Request(
            request_id=request_id,
            num_prompt_tokens=num_prompt,
            block_hashes=_adapter_salted(_block_hashes(prompt_token_ids, cfg.block_size), adapter),
            seed=seed,
            num_output_tokens=num_output,
            last_finish_reason="length" if ignore_eos or max_tokens < natural else "stop",
            num_final_blocks=_ceil_div(num_prompt + num_output, cfg.block_size),
            on_abort=on_abort,
            pooling=pooling,
            adapter=adapter,
        )
        return self._stream(request)

    def abort(self, request_id: str) -> None:
        """Free the request's slot and blocks (or dequeue it) now; its stream ends without a
        finish reason. Unknown or already finished ids are ignored, as in vLLM."""
        request = self._requests.get(request_id)
        if request is not None:
            self._release(request, aborted=True)

    async def close(self) -> None:
        """Stop the loop; streams still open end as if aborted, so no consumer hangs."""
        self._closed = True
        for request in list(self._requests.values()):
            self._release(request, aborted=True)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _stream(self, request: _Request) -> AsyncIterator[TokenOutput]:
        self._enqueue(request)
        loop = asyncio.get_running_loop()
        taken = False  # the consumer took the last output and came back for more
        try:
            while True:
                output = request.take()
                if output is not None:
                    yield output
                    if output.finish_reason is not None:
                        taken = True
                        return
                elif request.state == _DONE:
                    return  # aborted: no more tokens will come
                elif self._failure is not None:
                    raise EngineError("simulated engine loop failed") from self._failure
                else:
                    request.waiter = loop.create_future()
                    await request.waiter
                    request.waiter = None
        finally:
            if not taken and request.num_generated == request.num_output_tokens:
                # It finished while its consumer was behind, and the consumer left before
                # taking the end: to the consumer that is an abort, and it hears the cost.
                request.drop_pending()
                if request.on_abort is not None:
                    request.on_abort(_cost(request, prefilled=True))
            # Consumer closed or cancelled: free the slot now, not when the step loop notices.
            self._release(request, aborted=True)

    def _enqueue(self, request: _Request) -> None:
        if self._closed:
            raise EngineError("simulated engine is closed")
        if self._failure is not None:
            raise EngineError("simulated engine loop failed") from self._failure
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        self._requests[request.request_id] = request
        self._waiting[request.request_id] = request
        if self._events is not None:
            self._events.accepted(request.request_id)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wakeup.set()

    def _release(self, request: _Request, *, aborted: bool) -> None:
        """Take a request out of the engine; idempotent, so every exit path can call it."""
        prefilled = request.state == _RUNNING
        if prefilled:
            del self._running[request.request_id]
            if request.adapter is not None:
                self._adapter_running[request.adapter] -= 1
            self._pool.release(
                request.block_hashes,
                request.num_anonymous_blocks,
                request.num_final_blocks - len(request.block_hashes) - request.num_anonymous_blocks,
            )
        elif request.state == _WAITING:
            del self._waiting[request.request_id]
        else:
            return
        request.state = _DONE
        del self._requests[request.request_id]
        if aborted:
            request.drop_pending()
            if request.on_abort is not None:
                request.on_abort(_cost(request, prefilled))
        request.wake()

    async def _run(self) -> None:
        cfg = self._config
        try:
            while True:
                if not self._running and not self._waiting:
                    self._publish()
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                prefill_tokens = self._schedule()
                self._publish(prefill_tokens)
                if not self._running:
                    # Unreachable while generate() rejects requests larger than the cache (an
                    # empty engine fits any of those); wait rather than spin if it ever is.
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                delay = cfg.decode_base_s + cfg.decode_per_seq_s * len(self._running)
                if prefill_tokens:
                    delay += cfg.prefill_base_s + cfg.prefill_per_token_s * prefill_tokens
                delay += cfg.adapter_load_s * self._step_loads  # its workers load them first
                self._steps += 1
                await asyncio.sleep(delay * self._slow_factor)
                self._emit()
        except Exception as exc:
            # A bug here must not leave consumers waiting forever: fail them loudly.
            self._failure = exc
            for request in self._requests.values():
                request.wake()
            raise

    def _schedule(self) -> int:
        """One step's work within the token budget; returns the prefill tokens it computes.

        Marks the requests that get a token at the end of the step: those decoding now and
        those whose last prefill chunk is in this step (``_emitting``).
        """
        budget = self._config.max_num_batched_tokens
        self._step_loads = 0
        emitting: list[_Request] = []
        prefilling: list[_Request] = []
        for request in self._running.values():
            if request.prefill_left == 0:
                emitting.append(request)
                budget -= 1
            else:
                prefilling.append(request)
        start = budget
        for request in prefilling:
            if budget <= 0:
                break
            budget = _prefill_chunk(request, budget, emitting)
        while budget > 0:
            request = self._admit_one()
            if request is None:
                break
            budget = _prefill_chunk(request, budget, emitting)
        self._emitting = emitting
        return start - budget

    def _admit_one(self) -> _Request | None:
        """Admit the first waiting request whose adapter has a slot, if a sequence slot and its
        blocks are free (a request whose adapter has none is passed over, as vLLM does)."""
        cfg = self._config
        if not self._waiting or len(self._running) >= cfg.max_num_seqs:
            return None
        request = next((r for r in self._waiting.values() if self._adapter_fits(r.adapter)), None)
        if request is None:
            return None
        hashes = request.block_hashes
        num_prompt = request.num_prompt_tokens
        # Like vLLM, at least the last prompt token is recomputed to get logits, so a fully
        # cached block-aligned prompt hits one block less.
        hit_blocks = self._pool.matched_blocks(hashes, (num_prompt - 1) // cfg.block_size)
        # Hold blocks for the prompt plus the first output token's slot.
        num_anonymous = _ceil_div(num_prompt + 1, cfg.block_size) - len(hashes)
        if not self._pool.try_admit(hashes, num_anonymous, request.num_final_blocks):
            return None  # head-of-line waits for blocks, as in vLLM's FCFS policy
        del self._waiting[request.request_id]
        self._running[request.request_id] = request
        if request.adapter is not None:
            self._activate(request.adapter)
        request.state = _RUNNING
        request.num_anonymous_blocks = num_anonymous
        request.num_cached_tokens = hit_blocks * cfg.block_size
        request.prefill_left = num_prompt - request.num_cached_tokens
        self._prefix_cache_queries += num_prompt
        self._prefix_cache_hits += request.num_cached_tokens
        return request

    def _adapter_fits(self, adapter: str | None) -> bool:
        """Whether a request of ``adapter`` may run now: no adapter, a resident one, a free slot,
        or a resident one that no running request uses (to evict)."""
        if adapter is None or adapter in self._adapters:
            return True
        if len(self._adapters) < self._config.max_loras:
            return True
        return any(not self._adapter_running.get(a) for a in self._adapters)

    def _activate(self, adapter: str) -> None:
        """Mark ``adapter`` in use; load it (evicting the least recently used idle one) if it is
        not resident. ``_adapter_fits`` said there is room."""
        if adapter in self._adapters:
            self._adapters.move_to_end(adapter)
        else:
            if len(self._adapters) >= self._config.max_loras:
                idle = next(a for a in self._adapters if not self._adapter_running.get(a))
                del self._adapters[idle]
                self._adapter_running.pop(idle, None)
            self._adapters[adapter] = None
            self._adapter_loads += 1
            self._step_loads += 1
        self._adapter_running[adapter] = self._adapter_running.get(adapter, 0) + 1

    def prefill_backlog(self) -> int:
        """Prompt tokens still to prefill: what is left of the prefills under way, plus the
        uncached part of every waiting prompt as the cache stands now."""
        block_size = self._config.block_size
        backlog = sum(r.prefill_left for r in self._running.values())
        for request in self._waiting.values():
            limit = (request.num_prompt_tokens - 1) // block_size
            hit = self._pool.matched_blocks(request.block_hashes, limit)
            backlog += request.num_prompt_tokens - hit * block_size
        return backlog

    def _publish(self, step_prefill_tokens: int = 0) -> None:
        """Flush this step's events with the load: the step's own prefill counts as queued,
        since a request arriving now waits for the step to end."""
        if self._events is None:
            return
        self._events.flush(
            EngineLoad(
                backlog=self.prefill_backlog() + step_prefill_tokens,
                running=len(self._running),
                waiting=len(self._waiting),
                slots=self._config.max_num_seqs,
            )
        )

    def _emit(self) -> None:
        """End of step: one token for every request decoding or done with its prefill."""
        block_size = self._config.block_size
        num_words = len(OUTPUT_WORDS)
        emitting = [r for r in self._emitting if r.state == _RUNNING]  # not aborted meanwhile
        self._emitting = []
        self._generation_tokens += sum(not r.pooling for r in emitting)
        for request in emitting:
            index = request.num_generated
            word = _mix64(request.seed + index + 1) % num_words
            last = index + 1 == request.num_output_tokens
            request.add(
                _OUTPUT_IDS[word],
                OUTPUT_WORDS[word],
                index,
                request.last_finish_reason if last else None,
            )
            request.num_generated = index + 1
            if last:
                self._release(request, aborted=False)
                continue
            request.wake()
            if (request.num_prompt_tokens + index + 1) % block_size == 0:
                # The next token starts a new block: take it from this request's reservation.
                self._pool.grow()
                request.num_anonymous_blocks += 1
