"""The simulated engine: ``SimulatedLLM`` behind the OpenAI-level ``Engine`` interface.

This layer does what vLLM's OpenAI serving layer does over its engine: render the chat
template, count prompt tokens with the same tokenizer the gateway estimates with, enforce the
context length, and format chunks exactly as vLLM streams them (one token per chunk, a final
chunk with ``finish_reason``, and a usage chunk with empty ``choices`` when asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass

import orjson

from serve_app import errors, tokenizer
from serve_app.adapters import request_adapter
from serve_app.config.models import SimulatedEngineConfig
from serve_app.engines.base import AbandonedUsage, Engine, EngineStats, Kind, Usage
from serve_app.engines.embeddings import (
    embed_tokens,
    embedding_response,
    encode_vector,
    output_dimensions,
)
from serve_app.engines.logprobs import Logprobs, asked
from serve_app.engines.output_rules import JsonShape, StopMatcher, stop_strings
from serve_app.engines.paced import paced_tokens
from serve_app.engines.simulated_llm import SimulatedLLM, SimulatedLLMConfig, TokenOutput
from serve_app.engines.tool_calls import ToolCall, plan_tool_calls
from serve_app.engines.vllm_checks import check_request
from serve_app.kvcache.events import KvEventPublisher
from serve_app.protocol import embedding_inputs, prompt_text


class SimulatedEngine(Engine):
    def __init__(
        self,
        model: str,
        config: SimulatedEngineConfig,
        default_max_tokens: int,
        kv_events: KvEventPublisher | None = None,
        adapters: Collection[str] = (),
    ) -> None:
        self.model = model
        # vLLM's ``stop_reason`` in each choice (the stop string that ended it); off where this
        # engine plays an OpenAI-compatible API that has none (``mock_openai.py``).
        self.stop_reason = True
        # Tool calls as Gemini's OpenAI-compatible endpoint sends them: streamed deltas without
        # an ``index``, and the first call of an answer signed (``extra_content``); on where
        # this engine plays that endpoint (``mock_openai.py``).
        self.gemini_tool_calls = False
        self.adapters = frozenset(adapters)  # the pool's LoRA adapters, by name
        self.config = config
        self.default_max_tokens = default_max_tokens
        self._serial = 0
        self.abandoned = AbandonedUsage()
        self.llm = SimulatedLLM(
            SimulatedLLMConfig(
                max_num_seqs=config.max_num_seqs,
                block_size=config.block_size,
                num_kv_blocks=config.num_kv_blocks,
                prefill_base_s=config.prefill_base_s,
                prefill_per_token_s=config.prefill_per_token_s,
                decode_base_s=config.decode_base_s,
                decode_per_seq_s=config.decode_per_seq_s,
                output_tokens_min=config.output_tokens_min,
                output_tokens_max=config.output_tokens_max,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_loras=config.max_loras,
                adapter_load_s=config.adapter_load_s,
            )
        )
        self.llm.events = kv_events

    async def start(self) -> None:
        """Nothing to load: the scheduler loop starts with the first request."""

    @property
    def context_window(self) -> int:
        return self.config.max_model_len

    async def count_prompt(self, body: dict) -> int:
        return len(tokenizer.encode(prompt_text(body, "chat")))

    def _generate(self, body: dict, kind: Kind, request_id: str, *, pieces: bool = False):
        """Validate like vLLM (400 for what can never fit) and start the token stream, shaped
        by ``stop`` and ``response_format`` (``output_rules.py``); with the flag a stop string
        sets when it ends the generation."""
        ids, max_tokens = self._prepare(body, kind)
        adapter = self._adapter(body)
        # Client request ids may repeat; the engine's must not (vLLM suffixes them too).
        self._serial += 1
        stopped = _StopFlag()
        try:
            tokens = self.llm.generate(
                f"{request_id}-{self._serial}",
                ids,
                max_tokens,
                seed_text=None if body.get("seed") is None else str(body["seed"]),
                ignore_eos=bool(body.get("ignore_eos")),
                # A stop string ends the generation by aborting it: finished, not abandoned.
                on_abort=lambda usage: stopped or self.abandoned.record(request_id, usage),
                adapter=adapter,
            )
        except ValueError as exc:
            raise errors.invalid_request(str(exc), code="context_length_exceeded") from None
        thinking = self._thinking(body, kind)
        return ids, _shaped(tokens, body, stopped, thinking, pieces=pieces), stopped

    def _thinking(self, body: dict, kind: Kind) -> int:
        """How many of the answer's first tokens are reasoning: the configured number on chat,
        unless the request turns thinking off as Qwen3's template reads it."""
        kwargs = body.get("chat_template_kwargs")
        off = isinstance(kwargs, dict) and kwargs.get("enable_thinking") is False
        return 0 if kind != "chat" or off else self.config.reasoning_tokens

    def _usage(self, ids: list[int], generated: int, cached: int, reasoning: int) -> Usage:
        """Usage as vLLM counts it: reasoning tokens reported only where a parser is."""
        parsed = self.config.reasoning_tokens > 0
        return Usage(len(ids), generated, cached, reasoning if parsed else None)

    def _adapter(self, body: dict) -> str | None:
        """The request's LoRA adapter, one of the pool's (a 404 naming it otherwise)."""
        adapter = request_adapter(body)
        if adapter is not None and adapter not in self.adapters:
            raise errors.adapter_not_found(self.model, adapter)
        return adapter

    def _prepare(self, body: dict, kind: Kind) -> tuple[list[int], int]:
        field = "messages" if kind == "chat" else "prompt"
        if body.get("continue_final_message") and body.get("add_generation_prompt", True):
            raise errors.invalid_request(  # vLLM's check, in its words
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        try:
            ids = tokenizer.encode(prompt_text(body, kind))
        except (KeyError, IndexError, TypeError, AttributeError):
            # vLLM validates the body with its own request model: a 400 naming the field.
            raise errors.invalid_request(
                f"'{field}' is missing or malformed.", param=field
            ) from None
        if not ids:  # vLLM's words for an empty prompt: nothing to do with the context
            raise errors.invalid_request("The decoder prompt cannot be empty", param=field)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        max_tokens = max_tokens or self.default_max_tokens
        limit = self.config.max_model_len
        # vLLM's checks, in its words, so clients that parse them keep working: a prompt the
        # context cannot hold, or a max_tokens it never could, is refused; a max_tokens past
        # what the context has left after the prompt is cut to it.
        if len(ids) >= limit:
            raise errors.invalid_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {len(ids)} input tokens, which exceeds this limit even without any "
                "output tokens. Please reduce the length of the input prompt.",
                param=field,
                code="context_length_exceeded",
            )
        if max_tokens > limit:
            raise errors.invalid_request(
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. "
                "Please request fewer output tokens.",
                param="max_tokens",
                code="invalid_value",  # what Forge makes of vLLM's (``vllm_engine.py``)
            )
        return ids, min(max_tokens, limit - len(ids))

    def _generate_calls(self, body: dict, request_id: str, calls: list[ToolCall]):
        """The tool calls' arguments as the model's tokens: one generated token per piece, cut
        where ``max_tokens`` cuts them (as a real model's are); a reasoning model's reasoning
        first (pieces of call -1: the model's own words)."""
        ids, max_tokens = self._prepare(body, "chat")
        pieces = [(_REASONING, "")] * self._thinking(body, "chat")
        pieces += [
            (i, piece)
            for i, call in enumerate(calls)
            for piece in (tokenizer.tokenize(call.arguments) or [call.arguments])
        ]
        self._serial += 1
        tokens = self.llm.generate(
            f"{request_id}-{self._serial}",
            ids,
            min(len(pieces), max_tokens),
            seed_text=None if body.get("seed") is None else str(body["seed"]),
            ignore_eos=True,
            on_abort=lambda usage: self.abandoned.record(request_id, usage),
            adapter=self._adapter(body),
        )
        # vLLM (as OpenAI) finishes a call of a named tool with "stop", others with "tool_calls".
        named = isinstance(body.get("tool_choice"), dict)
        finish = ("stop" if named else "tool_calls") if len(pieces) <= max_tokens else "length"
        return ids, tokens, pieces[:max_tokens], finish

    async def _stream_calls(
        self, body: dict, request_id: str, calls: list[ToolCall]
    ) -> AsyncIterator[bytes | Usage]:
        ids, tokens, pieces, finish = self._generate_calls(body, request_id, calls)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk = _ChunkFormat("chat", request_id, self.model, include_usage, self.stop_reason)
        shown = body.get("include_reasoning") is not False  # vLLM's switch
        generated = cached = reasoning = 0
        started: set[int] = set()
        done = handed = False
        try:
            async with contextlib.aclosing(tokens):
                async for out in tokens:
                    if generated == 0:
                        yield chunk.role()
                    cached = out.num_cached_tokens
                    # A merged output (a consumer that fell behind) is still a chunk per piece:
                    # the pieces exist already, so this holds no more than one chunk would.
                    for k in range(out.num_tokens):
                        index, piece = pieces[generated]
                        generated += 1
                        if index == _REASONING:
                            reasoning += 1
                            if shown:
                                yield chunk.reasoning(out.pieces[k])
                            continue
                        first = index not in started
                        started.add(index)
                        yield chunk.tool_call(
                            index, piece, calls[index] if first else None, self.gemini_tool_calls
                        )
            done = True
            if generated == len(pieces):
                yield chunk.finish(finish)
            usage = self._usage(ids, generated, cached, reasoning)
            if include_usage:
                yield chunk.usage(usage)
            handed = True
            yield usage
        finally:
            if done and not handed:  # see ``stream``
                self.abandoned.record(request_id, Usage(len(ids), generated, cached))

    async def _complete_calls(
        self, body: dict, request_id: str, calls: list[ToolCall]
    ) -> tuple[dict, Usage]:
        ids, tokens, pieces, finish = self._generate_calls(body, request_id, calls)
        arguments = ["" for _ in calls]
        thoughts: list[str] = []
        generated = cached = 0
        async with contextlib.aclosing(tokens):
            async for out in tokens:
                for k in range(out.num_tokens):
                    index, piece = pieces[generated]
                    if index == _REASONING:
                        thoughts.append(out.pieces[k])
                    else:
                        arguments[index] += piece
                    generated += 1
                cached = out.num_cached_tokens
        usage = self._usage(ids, generated, cached, len(thoughts))
        message: dict = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": arguments[i]},
                    **(_signature(call) if self.gemini_tool_calls and i == 0 else {}),
                }
                for i, call in enumerate(calls)
                if arguments[i] or i == 0
            ],
        }
        if self.config.reasoning_tokens:
            shown = body.get("include_reasoning") is not False
            message["reasoning"] = "".join(thoughts) if thoughts and shown else None
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            **({"stop_reason": None} if self.stop_reason else {}),
        }
        return self._response("chat", request_id, choice, usage), usage

    async def stream(self, body: dict, kind: Kind, request_id: str) -> AsyncIterator[bytes | Usage]:
        # What vLLM's serving layer refuses is refused first, before anything reads the body:
        # a malformed field is the client's 400, never a replica's 5xx (a breaker's failure).
        check_request(body, kind)
        calls = plan_tool_calls(body, request_id) if kind == "chat" else []
        if calls:
            async with contextlib.aclosing(self._stream_calls(body, request_id, calls)) as items:
                async for item in items:
                    yield item
            return
        if self.config.paced_tokens_per_s is not None:
            async with contextlib.aclosing(self._stream_paced(body, kind, request_id)) as items:
                async for item in items:
                    yield item
            return
        described = _described(body, kind)
        ids, tokens, stopped = self._generate(body, kind, request_id, pieces=described is not None)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        shown = body.get("include_reasoning") is not False  # vLLM's switch
        chunk = _ChunkFormat(kind, request_id, self.model, include_usage, self.stop_reason)
        completion_tokens = cached = reasoning_tokens = 0
        done = handed = False
        try:
            # Closing this stream must abort the request now, not when the GC finalises it.
            async with contextlib.aclosing(tokens):
                # One chunk per engine output, as vLLM's serving layer streams them: a token
                # each, or several merged for a consumer that fell behind (``_Request.take``).
                async for out in tokens:
                    cached = out.cached
                    if completion_tokens == 0 and kind == "chat":
                        yield chunk.role()  # like vLLM: with the first token, after prefill
                    completion_tokens += out.num_tokens
                    reasoning_tokens += out.num_reasoning
                    if out.reasoning and shown:
                        yield chunk.reasoning(out.reasoning)
                    if out.text:
                        said = None if described is None else described.of(out.pieces)
                        yield chunk.token(out.text, said)
                    if out.finish_reason is not None:
                        yield chunk.finish(out.finish_reason, stopped.string)
            done = True
            usage = self._usage(ids, completion_tokens, cached, reasoning_tokens)
            if include_usage:
                yield chunk.usage(usage)
            handed = True
            yield usage
        finally:
            if (done or stopped) and not handed:
                # The engine is done with it (it finished, or a stop string ended it, which is
                # no abandonment) but the caller left before its usage came: charged all the
                # same, once. A stream left while the engine still generated is the engine's
                # abort to report (``on_abort``), what it generated included.
                self.abandoned.record(request_id, Usage(len(ids), completion_tokens, cached))

    async def _stream_paced(
        self, body: dict, kind: Kind, request_id: str
    ) -> AsyncIterator[bytes | Usage]:
        """A benchmark's stream (``engines/paced.py``): off the batched steps, each token's
        text its emission time; usage as any stream's, abandoned usage when the caller left."""
        assert self.config.paced_tokens_per_s is not None
        described = _described(body, kind)
        ids, max_tokens = self._prepare(body, kind)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        chunk = _ChunkFormat(kind, request_id, self.model, include_usage, self.stop_reason)
        generated = 0
        handed = False
        try:
            async for text, last in paced_tokens(max_tokens, self.config.paced_tokens_per_s):
                if generated == 0 and kind == "chat":
                    yield chunk.role()
                generated += 1
                yield chunk.token(text, None if described is None else described.of((text,)))
                if last:
                    yield chunk.finish("length")
            usage = Usage(len(ids), generated, 0)
            if include_usage:
                yield chunk.usage(usage)
            handed = True
            yield usage
        finally:
            if not handed:
                self.abandoned.record(request_id, Usage(len(ids), generated, 0))

    async def complete(self, body: dict, kind: Kind, request_id: str) -> tuple[dict, Usage]:
        if kind == "embedding":
            return await self._embed(body, request_id)
        check_request(body, kind)  # first, as ``stream``'s
        calls = plan_tool_calls(body, request_id) if kind == "chat" else []
        if calls:
            return await self._complete_calls(body, request_id, calls)
        described = _described(body, kind)
        ids, tokens, stopped = self._generate(body, kind, request_id, pieces=described is not None)
        pieces: list[str] = []
        thoughts: list[str] = []
        said: list[dict] = []
        finish_reason = "stop"
        cached = generated = reasoning_tokens = 0
        async with contextlib.aclosing(tokens):
            async for out in tokens:
                cached = out.cached
                pieces.append(out.text)
                if described is not None and out.pieces:
                    said.append(described.of(out.pieces))
                thoughts.append(out.reasoning)
                generated += out.num_tokens
                reasoning_tokens += out.num_reasoning
                finish_reason = out.finish_reason or finish_reason
        usage = self._usage(ids, generated, cached, reasoning_tokens)
        text = "".join(pieces)
        if kind == "chat":
            # As vLLM's reasoning parser splits it: content null where the answer was all
            # reasoning; the reasoning null where there was none, or it was not asked for.
            reasoning = "".join(thoughts) if body.get("include_reasoning") is not False else ""
            message: dict = {"role": "assistant", "content": text}
            if self.config.reasoning_tokens:
                message = {**message, "content": text or None, "reasoning": reasoning or None}
            answer: dict = {"message": message}
        else:
            answer = {"text": text}
        choice = {
            "index": 0,
            **answer,
            "logprobs": None if described is None else Logprobs.merged(said, kind),
            "finish_reason": finish_reason,
            **({"stop_reason": stopped.string} if self.stop_reason else {}),
        }
        return self._response(kind, request_id, choice, usage), usage

    async def _embed(self, body: dict, request_id: str) -> tuple[dict, Usage]:
        """Every input is a request of its own, batched with the rest as vLLM batches them:
        a slot and a prefill each; the vector follows from the tokens (``embeddings.py``)."""
        native = self.config.embedding_dim
        dimensions = output_dimensions(body, native)
        encoding = body.get("encoding_format") or "float"
        inputs = [
            item if isinstance(item, list) else tokenizer.encode(item)
            for item in embedding_inputs(body)
        ]
        limit = self.config.max_model_len
        for i, ids in enumerate(inputs):
            if not ids or len(ids) > limit:
                # vLLM's wording for an input that does not fit.
                raise errors.invalid_request(
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {len(ids)} tokens in the input for embedding generation "
                    f"(input {i}). Please reduce the length of the input.",
                    param="input",
                    code="context_length_exceeded",
                )
        self._serial += 1
        cached = 0

        async def pooled(i: int, ids: list[int]) -> list | str:
            nonlocal cached
            try:
                tokens = self.llm.generate(
                    f"{request_id}-{self._serial}-{i}", ids, 1, ignore_eos=True, pooling=True
                )
            except ValueError as exc:  # more KV blocks than the cache has
                raise errors.invalid_request(str(exc), param="input") from None
            async with contextlib.aclosing(tokens):
                async for out in tokens:
                    cached += out.num_cached_tokens
            return encode_vector(embed_tokens(ids, native), dimensions, encoding)

        data = await asyncio.gather(*(pooled(i, ids) for i, ids in enumerate(inputs)))
        usage = Usage(sum(len(ids) for ids in inputs), 0, cached)
        return embedding_response(request_id, self.model, data, usage.prompt_tokens), usage

    def _response(self, kind: Kind, request_id: str, choice: dict, usage: Usage) -> dict:
        """The non-streaming envelope around one choice, as vLLM returns it."""
        chat = kind == "chat"
        return {
            "id": ("chatcmpl-" if chat else "cmpl-") + request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": usage.to_openai(),
        }

    def stats(self) -> EngineStats:
        llm = self.llm
        return EngineStats(
            num_requests_running=llm.num_requests_running,
            num_requests_waiting=llm.num_requests_waiting,
            kv_cache_usage_perc=llm.kv_cache_usage(),
            prefix_cache_queries=llm.prefix_cache_queries,
            prefix_cache_hits=llm.prefix_cache_hits,
            max_num_seqs=self.config.max_num_seqs,
            generation_tokens=llm.generation_tokens,
            prompt_tokens=llm.prompt_tokens,
            max_loras=self.config.max_loras if self.adapters else 0,
            running_lora_adapters=llm.running_adapters(),
            waiting_lora_adapters=llm.waiting_adapters(),
            lora_adapters=llm.resident_adapters(),
            lora_loads=llm.adapter_loads,
        )

    def cached_block_hashes(self) -> list[int]:
        return self.llm.cached_block_hashes()

    def set_slow_factor(self, factor: float) -> None:
        self.llm.slow_factor = factor

    async def check_health(self) -> None:
        """The simulator is healthy while its process is; injected faults live in the replica."""

    async def shutdown(self) -> None:
        await self.llm.close()


_REASONING = -1  # a tool-calling answer's piece that is the model's reasoning, not a call's


class _StopFlag:
    """Set when a stop string ended a generation (its abort is no abandonment); ``string`` is
    that stop string, vLLM's ``stop_reason``."""

    __slots__ = ("set", "string")

    def __init__(self) -> None:
        self.set = False
        self.string: str | None = None

    def __bool__(self) -> bool:
        return self.set


@dataclass(frozen=True, slots=True)
class _Shaped:
    """One engine output as it goes out: its reasoning and its answer's text, split where the
    reasoning ends, and what it holds."""

    reasoning: str
    text: str
    finish_reason: str | None
    cached: int
    num_tokens: int
    num_reasoning: int
    # The answer's text by token, for log-probabilities (one piece where JSON mode or a stop
    # string changed the text from the tokens').
    pieces: tuple[str, ...] = ()


async def _shaped(
    tokens: AsyncIterator[TokenOutput],
    body: dict,
    stopped: _StopFlag,
    thinking: int = 0,
    *,
    pieces: bool = False,
) -> AsyncIterator[_Shaped]:
    """Per engine output: the reasoning (its first ``thinking`` tokens, as vLLM's reasoning
    parser splits them off) and the answer's text, with JSON mode's wrapping and stop strings
    applied to the answer (vLLM's grammar starts where the reasoning ends). A stop string inside
    a merged output ends the text there; the output's tokens all count, since the engine
    generated them: vLLM, which checks stop strings per step, would have stopped at it.
    ``pieces``: the answer's text by token too, which only log-probabilities need.
    """
    shape = JsonShape.of(body)
    matcher = StopMatcher(stop_strings(body))
    first = True
    async with contextlib.aclosing(tokens):
        async for out in tokens:
            thought = min(max(thinking - out.index, 0), out.num_tokens)
            reasoning = "".join(out.pieces[:thought]) if thought else ""
            text = "".join(out.pieces[thought:]) if thought else out.text
            answering = thought < out.num_tokens
            if shape is not None and answering:
                text = (shape.opening if first else "") + shape.escape(text)
                if out.finish_reason == "stop":
                    text += shape.closing
                first = False
            text, hit = matcher.feed(text) if answering else (text, False)
            if hit:
                stopped.set = True  # closing `tokens` below aborts the rest of the generation
                stopped.string = matcher.matched
                yield _Shaped(
                    reasoning,
                    text,
                    "stop",
                    out.num_cached_tokens,
                    out.num_tokens,
                    thought,
                    _pieces(text, out.pieces[thought:]) if pieces else (),
                )
                return
            if out.finish_reason is not None:
                text += matcher.flush()
            yield _Shaped(
                reasoning,
                text,
                out.finish_reason,
                out.num_cached_tokens,
                out.num_tokens,
                thought,
                _pieces(text, out.pieces[thought:]) if pieces else (),
            )


def _pieces(text: str, tokens: tuple[str, ...]) -> tuple[str, ...]:
    """The answer's text by token: the tokens' own where the text is theirs, else one piece."""
    if "".join(tokens) == text:
        return tokens
    return (text,) if text else ()


def _described(body: dict, kind: Kind) -> Logprobs | None:
    """The request's log-probabilities to come, where it asks for them (a 400 first where it
    asks for more than vLLM gives)."""
    top = asked(body, kind)
    return None if top is None else Logprobs(kind, top)


def _signature(call: ToolCall) -> dict:
    """A thought signature, opaque as Gemini's are."""
    return {"extra_content": {"google": {"thought_signature": f"sig-{call.id}"}}}


class _ChunkFormat:
    """Pre-serialised chunk envelopes: per token only the content is encoded."""

    __slots__ = ("_head", "_kind", "_stop_reason", "_tail", "_usage_head")

    def __init__(
        self, kind: Kind, request_id: str, model: str, include_usage: bool, stop_reason: bool
    ) -> None:
        self._kind = kind
        self._stop_reason = stop_reason
        created = int(time.time())
        if kind == "chat":
            envelope = {"id": "chatcmpl-" + request_id, "object": "chat.completion.chunk"}
        else:
            envelope = {"id": "cmpl-" + request_id, "object": "text_completion"}
        envelope |= {"created": created, "model": model}
        head = orjson.dumps(envelope)[:-1]  # drop the closing brace
        self._head = b"data: " + head + b',"choices":[{"index":0,'
        usage_null = b',"usage":null' if include_usage else b""
        self._tail = b"}]" + usage_null + b"}\n\n"
        self._usage_head = b"data: " + head + b',"choices":[],"usage":'

    def _frame(self, choice_body: bytes) -> bytes:
        return self._head + choice_body + self._tail

    def role(self) -> bytes:
        return self._frame(
            b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null'
        )

    def reasoning(self, text: str) -> bytes:
        """Reasoning, as vLLM's reasoning parser streams it (a delta of its own)."""
        content = orjson.dumps(text)
        return self._frame(
            b'"delta":{"reasoning":' + content + b'},"logprobs":null,"finish_reason":null'
        )

    def token(self, text: str, logprobs: dict | None = None) -> bytes:
        content = orjson.dumps(text)
        described = b"null" if logprobs is None else orjson.dumps(logprobs)
        if self._kind == "chat":
            return self._frame(
                b'"delta":{"content":'
                + content
                + b'},"logprobs":'
                + described
                + b',"finish_reason":null'
            )
        return self._frame(
            b'"text":' + content + b',"logprobs":' + described + b',"finish_reason":null'
        )

    def tool_call(
        self, index: int, arguments: str, call: ToolCall | None = None, gemini: bool = False
    ) -> bytes:
        """One piece of a call's arguments; the call's first carries its id, type and name
        (``gemini``: no index, and the answer's first call signed, as Gemini sends them)."""
        entry: dict = {"index": index, "function": {"arguments": arguments}}
        if call is not None:
            entry = {
                "index": index,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": arguments},
            }
            if gemini and index == 0:
                entry |= _signature(call)
        if gemini:
            del entry["index"]
        return self._frame(
            b'"delta":{"tool_calls":' + orjson.dumps([entry]) + b'},"logprobs":null,'
            b'"finish_reason":null'
        )

    def finish(self, reason: str, stop_string: str | None = None) -> bytes:
        """The last chunk: its finish reason and, as vLLM's, its ``stop_reason``."""
        reasons = orjson.dumps(reason)
        if self._stop_reason:
            reasons += b',"stop_reason":' + orjson.dumps(stop_string)
        if self._kind == "chat":
            return self._frame(b'"delta":{},"logprobs":null,"finish_reason":' + reasons)
        return self._frame(b'"text":"","logprobs":null,"finish_reason":' + reasons)

    def usage(self, usage: Usage) -> bytes:
        return self._usage_head + orjson.dumps(usage.to_openai()) + b"}\n\n"
