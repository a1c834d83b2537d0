"""The vLLM engine: vLLM's async engine and its own OpenAI serving layer, in the replica's process.

Forge drives vLLM directly rather than through Ray Serve LLM's ``LLMServer`` (docs/vllm.md has
the evaluation): requests go through vLLM's ``OpenAIServingChat`` / ``OpenAIServingCompletion``
(the objects behind ``vllm serve``), so chat templates, tokenisation, validation and the chunk
format are vLLM's own, byte for byte. Forge adds only what its replica contract needs: usage for
metering on every stream, an abort the moment the caller goes away (and what the aborted stream
cost, counted from vLLM's outputs on their way to its serving layer), and the scheduler's numbers
(running, waiting, KV-cache use, prefix-cache queries and hits) for routing and dashboards.
vLLM's arguments come from ``vllm_args.py``; its KV-cache events reach the replica's publisher
through ``vllm_kv_relay.py``.

vLLM is imported lazily: this module imports (and its config validates) without vLLM installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal

import orjson

from serve_app import errors
from serve_app.adapters import ADAPTER_KEY, adapter_model, request_adapter, split_adapter_model
from serve_app.config.models import AdapterConfig, VLLMEngineConfig
from serve_app.engines.base import (
    AbandonedUsage,
    Engine,
    EngineError,
    EngineStats,
    Kind,
    Usage,
)
from serve_app.engines.vllm_args import import_first, vllm_server_args
from serve_app.engines.vllm_kv_relay import VllmKvEventRelay
from serve_app.kvcache.events import EngineLoad, KvEventPublisher

logger = logging.getLogger("ray.serve")


class VLLMEngine(Engine):
    """One vLLM ``AsyncLLM`` serving one model under the pool's model name.

    The model loads in the constructor, so a replica (and Serve's view of it) is only ready once
    vLLM can serve; ``start`` then builds the serving layer, which needs the event loop.
    """

    def __init__(
        self,
        model: str,
        config: VLLMEngineConfig,
        default_max_tokens: int,
        task: Literal["generate", "embed"] = "generate",
        kv_events: KvEventPublisher | None = None,
        adapters: Sequence[AdapterConfig] = (),
    ) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        self.model = model
        self.config = config
        self.default_max_tokens = default_max_tokens
        self._serial = 0
        # vLLM's streams carry no usage until their end: an aborted one's is what ``_counts``
        # saw vLLM hand its serving layer, recorded here for the gateway to collect.
        self.abandoned = AbandonedUsage()
        self._counts = StreamCounts()
        self._load = SchedulerLoad()
        # LoRA adapters by name; vLLM serves each under "<model>:<name>" (``vllm_args.py``).
        self.adapters = {a.name: a for a in adapters}
        self._args = vllm_server_args(model, config, task, adapters)
        _import_parser_plugins(self._args)  # before vLLM's config, which looks the parser up
        # Only a generation pool routes on its cache.
        self._kv = (
            VllmKvEventRelay(kv_events, self._engine_load)
            if kv_events is not None and task == "generate"
            else None
        )
        if self._kv is not None:
            self._args.kv_events_config = self._kv.vllm_config()
            self._load.on_update = self._kv.flush
        engine_args = AsyncEngineArgs.from_cli_args(self._args)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.context_window = vllm_config.model_config.max_model_len
        self.block_size = vllm_config.cache_config.block_size
        self._hash_algo = vllm_config.cache_config.prefix_caching_hash_algo
        self._load.max_loras = config.max_loras if adapters else 0
        try:
            self.llm = AsyncLLM.from_vllm_config(
                vllm_config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                stat_loggers=self._stat_loggers(),
                enable_log_requests=False,
                disable_log_stats=False,
            )
        except BaseException:
            if self._kv is not None:  # no shutdown will come: remove its socket's directory
                self._kv.remove_dir()
            raise
        # vLLM's serving layer streams through ``engine_client.generate``: counted on the way.
        # Set on the instance, so the serving layer is still handed the AsyncLLM itself.
        self.llm.generate = self._counts.counted(self.llm.generate)
        self._chat = None
        self._completion = None
        self._embedding = None
        self._tokenization = None
        self._started = False

    def _stat_loggers(self) -> list:
        """Forge's tap on the scheduler's numbers, and where vLLM's own metrics go.

        Inside Ray, vLLM's ``RayPrometheusStatLogger`` replaces its process-local Prometheus
        logger, so the ``vllm:*`` series reach the cluster's Prometheus through Ray's metrics
        agent (as with Ray Serve LLM). Outside Ray (engine tests) the local registry keeps them.
        """
        loggers: list = [self._load.per_engine_logger]
        if self.config.export_metrics_to_ray:
            import ray

            if ray.is_initialized():
                from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

                loggers.append(RayPrometheusStatLogger)
        return loggers

    async def start(self) -> None:
        """vLLM's serving layer, built exactly as ``vllm serve`` builds it (``init_app_state``)."""
        if self._started:
            return
        if self._kv is not None:
            # Subscribed before any request: PUB/SUB drops what is sent before it joins.
            self._kv.start()
        from starlette.datastructures import State

        init_app_state = import_first(
            "vllm.entrypoints.launchers.api_server.app_state:init_app_state",  # vLLM >= 0.30
            "vllm.entrypoints.openai.api_server:init_app_state",
        )
        state = State()
        kwargs: dict[str, Any] = {}
        parameters = inspect.signature(init_app_state).parameters
        if "supported_tasks" in parameters:
            kwargs["supported_tasks"] = await self.llm.get_supported_tasks()
        if "vllm_config" in parameters:
            kwargs["vllm_config"] = self.llm.vllm_config
        await init_app_state(self.llm, state, self._args, **kwargs)
        # A generation model has the first two, a pooling model the last (None: not served).
        self._chat = getattr(state, "openai_serving_chat", None)
        self._completion = getattr(state, "openai_serving_completion", None)
        self._embedding = getattr(state, "serving_embedding", None)
        self._tokenization = getattr(state, "serving_tokenization", None)  # vLLM's /tokenize
        self._started = True

    async def count_prompt(self, body: dict) -> int:
        """The prompt as vLLM renders it for ``body`` (its template, tools, prefill, the
        template's arguments), counted by vLLM's own ``/tokenize``."""
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeChatRequest

        await self.start()
        adapter = request_adapter(body)
        fields = ("messages", "tools", "chat_template_kwargs", "add_generation_prompt")
        payload = {k: body[k] for k in fields if body.get(k) is not None}
        payload["model"] = adapter_model(self.model, adapter)
        if body.get("continue_final_message") is True:
            payload["continue_final_message"] = True
        request = _validated(TokenizeChatRequest, payload)
        result = await self._tokenization.create_tokenize(request, raw_request=None)
        error = getattr(result, "error", None)  # vLLM's ErrorResponse: the request's fault
        if error is not None:
            raise _forge_error(error.code, error.message, error.param)
        return result.count

    # -- requests ------------------------------------------------------------------------------

    def _request(self, body: dict, kind: Kind, request_id: str, stream: bool):
        """vLLM's request object for ``body`` and the vLLM request ids to abort it by."""

        if kind == "chat":
            from vllm.entrypoints.openai.chat_completion.protocol import (
                ChatCompletionRequest as request_class,
            )
        else:
            from vllm.entrypoints.openai.completion.protocol import (
                CompletionRequest as request_class,
            )
        # Client request ids may repeat; vLLM's must not (an abort by id would hit both).
        self._serial += 1
        base_id = f"{request_id}-{self._serial}"
        # vLLM picks its response type from the body's flag: make it say what the caller does.
        # Its serving layer attaches a LoRARequest to a request that names an adapter's model.
        adapter = request_adapter(body)
        if adapter is not None and adapter not in self.adapters:
            raise errors.adapter_not_found(self.model, adapter)
        model = adapter_model(self.model, adapter)
        payload = {**body, "model": model, "request_id": base_id, "stream": stream}
        payload.pop(ADAPTER_KEY, None)
        self._load.used(adapter)
        if payload.get("max_tokens") is None and payload.get("max_completion_tokens") is None:
            payload["max_tokens"] = self.default_max_tokens
        if stream:
            # Metering needs usage on every stream; the frame is dropped if the client didn't ask.
            payload["stream_options"] = {
                **(body.get("stream_options") or {}),
                "include_usage": True,
            }
        return _validated(request_class, payload), _vllm_request_ids(kind, base_id, body)

    async def _serve(self, request, kind: Kind):
        """Run one request through vLLM's serving layer; its 4xx become Forge's 4xx."""
        await self.start()
        serving = self._chat if kind == "chat" else self._completion
        if serving is None:  # the gateway sends no such request (its parse stage refuses it)
            raise errors.wrong_route(self.model, embeddings=False)
        if self._kv is not None:
            # "<forge id>-<n>", as the simulated engine says it; vLLM's own ids add a prefix.
            self._kv.accepted(request.request_id)
        try:
            if kind == "chat":
                result = await serving.create_chat_completion(request, raw_request=None)
            else:
                result = await serving.create_completion(request, raw_request=None)
        except Exception as exc:  # vLLM raises some validation errors instead of returning them
            result = _error_response_for(serving, exc)
        error = getattr(result, "error", None)  # vLLM's ErrorResponse
        if error is not None:
            raise _forge_error(error.code, error.message, error.param)
        return result

    async def stream(self, body: dict, kind: Kind, request_id: str) -> AsyncIterator[bytes | Usage]:
        request, vllm_ids = self._request(body, kind, request_id, stream=True)
        client_wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        with self._counts.open(vllm_ids, kind) as count:
            frames = await self._serve(request, kind)
            usage: Usage | None = None
            ended = False
            try:
                async for frame in frames:
                    if frame.startswith("data: [DONE]"):
                        continue  # the gateway ends the stream, not the engine
                    if frame.startswith('data: {"error"'):
                        raise EngineError(_stream_error_message(frame))
                    data = frame.encode()
                    if '"choices":[]' in frame and '"usage":{' in frame:
                        usage = _usage_of(orjson.loads(data[6:])["usage"])
                        if not client_wants_usage:
                            continue
                    yield data
                ended = True
            finally:
                if usage is None:
                    # Cancelled or closed early (client gone, deadline, failure): free the slot
                    # now, not when the garbage collector finalises vLLM's generators.
                    await self._abort(vllm_ids)
                with contextlib.suppress(Exception):
                    await frames.aclose()  # after it, nothing more reaches the count
                if not (ended and usage is not None):
                    self._record_abandoned(request_id, usage or count.usage())
        if usage is None:  # never with include_usage forced on; a broken stream if it happens
            raise EngineError("vLLM's stream ended without its usage chunk")
        yield usage

    def _record_abandoned(self, request_id: str, usage: Usage | None) -> None:
        """What a stream that will not yield its ``Usage`` cost (or a non-streamed generation
        cancelled: ``_abandon``), for ``Replica.abandoned_usage``.

        Exactly the streams whose ``Usage`` never reaches the replica are recorded here, and the
        replica records a ``Usage`` only once it has it, so no stream is charged twice: a stream
        that ended yields its ``Usage`` and is never recorded here. ``usage`` is vLLM's own
        final count when its usage chunk came before the end (a stream left at ``[DONE]``),
        else the count of what vLLM handed the stream; None when that is unknown, and the
        gateway charges its estimate.
        """
        if usage is not None:
            self.abandoned.record(request_id, usage)

    async def complete(self, body: dict, kind: Kind, request_id: str) -> tuple[dict, Usage]:
        if kind == "embedding":
            return await self._embed(body, request_id)
        request, vllm_ids = self._request(body, kind, request_id, stream=False)
        with self._counts.open(vllm_ids, kind) as count:
            try:
                response = await self._serve(request, kind)
            except asyncio.CancelledError:
                await self._abandon(request_id, vllm_ids, count)
                raise
            except errors.ForgeError:
                if not _being_cancelled():
                    raise
                # vLLM's serving layer answers a cancelled generation with an error ("Client
                # disconnected") instead of letting the cancellation through.
                await self._abandon(request_id, vllm_ids, count)
                raise asyncio.CancelledError from None
        # What vLLM's server returns for it (JSONResponse(content=response.model_dump())).
        body_out = response.model_dump()
        return body_out, _usage_of(body_out["usage"])

    async def _embed(self, body: dict, request_id: str) -> tuple[dict, Usage]:
        """``/v1/embeddings`` through vLLM's ``ServingEmbedding`` (what ``vllm serve`` runs for a
        pooling model), its JSON response taken as it would be sent."""
        from pydantic import TypeAdapter, ValidationError
        from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

        await self.start()
        if self._embedding is None:
            raise errors.invalid_request(
                "This pool's model does not serve embeddings (vLLM's runner is not 'pooling').",
                param="model",
                code="unsupported_model",
            )
        self._serial += 1
        base_id = f"{request_id}-{self._serial}"
        try:
            request = TypeAdapter(EmbeddingRequest).validate_python(
                {**body, "model": self.model, "request_id": base_id}
            )
        except ValidationError as exc:
            raise errors.invalid_request(_first_error(exc)) from None
        inputs = body.get("input")
        count = len(inputs) if isinstance(inputs, list) and not isinstance(inputs[0], int) else 1
        try:
            result = await self._embedding(request, raw_request=None)
        except asyncio.CancelledError:
            # Nothing for ``abandoned``: embeddings never stream, so the gateway never asks, and
            # vLLM's pooling outputs (token counts included) come only whole, at the end.
            await self._abort([f"embd-{base_id}-{i}" for i in range(count)])
            raise
        except Exception as exc:  # vLLM's front end maps these with its exception handlers
            result = _error_response_for(self._embedding, exc)
        error = getattr(result, "error", None)
        if error is not None:
            raise _forge_error(error.code, error.message, error.param)
        response = orjson.loads(result.body)
        if result.status_code >= 400:
            error = response.get("error") or {}
            raise _forge_error(result.status_code, error.get("message", ""), error.get("param"))
        return response, _usage_of(response["usage"])

    async def _abandon(self, request_id: str, vllm_ids: list[str], count: StreamCount) -> None:
        """A non-streamed generation cancelled (its caller left): aborted now, and what it cost
        so far recorded for the gateway's question (``Replica.abandoned_usage``)."""
        await self._abort(vllm_ids)
        self._record_abandoned(request_id, count.usage())

    async def _abort(self, vllm_ids: list[str]) -> None:
        with contextlib.suppress(Exception):  # already finished, or the engine is gone
            await self.llm.abort(vllm_ids)

    # -- state -----------------------------------------------------------------------------------

    def _engine_load(self) -> EngineLoad:
        # backlog 0: vLLM reports no per-request prefill progress, so the prefill work queued
        # here is unknown; routers fall back on running and waiting.
        return EngineLoad(
            backlog=0,
            running=self._load.running,
            waiting=self._load.waiting,
            slots=self.max_num_seqs,
        )

    async def reset_prefix_cache(self) -> bool:
        """Empty vLLM's prefix cache and tell the routers at once.

        vLLM queues its ``AllBlocksCleared`` and publishes it with its next step's events, and
        an idle engine takes no step: until its next request the routers would send prompts
        here for blocks it no longer holds. False (nothing said) if vLLM refused the reset
        (blocks still in use).
        """
        reset = bool(await self.llm.reset_prefix_cache())
        if reset and self._kv is not None:
            self._kv.cleared()
        return reset

    def block_hashing(self) -> dict | None:
        """What a router needs to name blocks as this engine does (``kvcache/
        vllm_block_hashes.py``): its engine core's seed is this process's ``PYTHONHASHSEED``,
        inherited when vLLM spawned it. A non-cryptographic algorithm's seed is random per
        process and not said (the routers cannot follow it, and it must stay secret)."""
        if self._kv is None:
            return None
        if self._hash_algo not in ("sha256", "sha256_cbor"):
            return {"algo": self._hash_algo, "block_size": self.block_size}
        seed = os.environ.get("PYTHONHASHSEED")
        return {"algo": self._hash_algo, "seed": seed, "block_size": self.block_size}

    def cached_block_hashes(self) -> list[int]:
        return [] if self._kv is None else list(self._kv.held)

    def stats(self) -> EngineStats:
        load = self._load
        return EngineStats(
            num_requests_running=load.running,
            num_requests_waiting=load.waiting,
            kv_cache_usage_perc=load.kv_cache_usage,
            prefix_cache_queries=load.prefix_cache_queries,
            prefix_cache_hits=load.prefix_cache_hits,
            max_num_seqs=self.max_num_seqs,
            generation_tokens=load.generation_tokens,
            prompt_tokens=load.prompt_tokens,
            max_loras=load.max_loras,
            running_lora_adapters=dict(load.running_lora_adapters),
            waiting_lora_adapters=dict(load.waiting_lora_adapters),
            lora_adapters=list(load.resident),
            lora_loads=load.lora_loads,
        )

    async def check_health(self) -> None:
        try:
            await self.llm.check_health()
        except Exception as exc:
            raise EngineError(f"vLLM engine is dead: {exc}") from exc

    async def shutdown(self) -> None:
        """Stop vLLM's engine-core process. Serve has drained the replica's requests by now."""
        if self._kv is not None:
            await self._kv.close()
        self.llm.shutdown()


class SchedulerLoad:
    """vLLM's scheduler numbers, kept as vLLM's Prometheus logger records them.

    vLLM hands every scheduler and iteration update to its stat loggers; this one keeps the
    latest gauges and sums the counters, so ``stats()`` equals ``vllm:num_requests_running``,
    ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
    ``vllm:prefix_cache_{queries,hits}_total`` and ``vllm:generation_tokens_total`` without
    scraping anything. It is vLLM's per-engine ``StatLoggerBase`` by duck typing, so this module
    imports without vLLM.
    """

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.generation_tokens = 0
        self.prompt_tokens = 0
        # LoRA: vllm:lora_requests_info's adapters (by Forge's adapter name, with counts), and
        # the adapters vLLM holds in its max_loras slots as its LRU would: vLLM does not say
        # which are loaded, so they are kept here in the order requests used them.
        self.max_loras = 0
        self.running_lora_adapters: dict[str, int] = {}
        self.waiting_lora_adapters: dict[str, int] = {}
        self.resident: OrderedDict[str, None] = OrderedDict()
        self.lora_loads = 0
        # Called after each scheduler update: the KV event relay republishes the load with it.
        self.on_update: Callable[[], None] | None = None

    def per_engine_logger(self, vllm_config: Any, engine_index: int = 0) -> SchedulerLoad:
        """vLLM's per-engine stat logger factory. One engine core per replica: one tap."""
        return self

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0) -> None:
        if iteration_stats is not None:
            self.generation_tokens += iteration_stats.num_generation_tokens
            self.prompt_tokens += iteration_stats.num_prompt_tokens
        if scheduler_stats is None:
            return
        self.running = scheduler_stats.num_running_reqs
        # vllm:num_requests_waiting counts deferred requests too.
        self.waiting = scheduler_stats.num_waiting_reqs + getattr(
            scheduler_stats, "num_skipped_waiting_reqs", 0
        )
        self.kv_cache_usage = scheduler_stats.kv_cache_usage
        self.running_lora_adapters = _adapter_counts(scheduler_stats, "running_lora_adapters")
        self.waiting_lora_adapters = _adapter_counts(scheduler_stats, "waiting_lora_adapters")
        self.prefix_cache_queries += scheduler_stats.prefix_cache_stats.queries
        self.prefix_cache_hits += scheduler_stats.prefix_cache_stats.hits
        if self.on_update is not None:
            self.on_update()

    def used(self, adapter: str | None) -> None:
        """A request of ``adapter`` is sent to vLLM: it is (or becomes) resident, and the least
        recently used one past ``max_loras`` is not."""
        if adapter is None or not self.max_loras:
            return
        if adapter in self.resident:
            self.resident.move_to_end(adapter)
            return
        self.resident[adapter] = None
        self.lora_loads += 1
        while len(self.resident) > self.max_loras:
            self.resident.popitem(last=False)

    def log(self) -> None:
        """Nothing to print: vLLM's own logging logger does that."""

    def log_engine_initialized(self) -> None:
        """Nothing to announce."""

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        """Sleep mode is not used by Forge."""


def _import_parser_plugins(args: Any) -> None:
    """What ``vllm serve`` does before it builds its serving layer: a tool-call or reasoning
    parser plugin's module registers its parsers (``engine_args``' ``tool_parser_plugin``,
    ``reasoning_parser_plugin``), or the parser it names is unknown. vLLM's engine core imports
    the reasoning plugin for its grammar itself."""
    if getattr(args, "tool_parser_plugin", None):
        from vllm.tool_parsers import ToolParserManager

        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    if getattr(args, "reasoning_parser_plugin", None):
        from vllm.reasoning import ReasoningParserManager

        ReasoningParserManager.import_reasoning_parser(args.reasoning_parser_plugin)


class StreamCounts:
    """The tokens vLLM hands each open stream, counted on their way to its serving layer.

    vLLM puts usage in a stream only at its end, so what an aborted stream cost is known only
    to whoever watched its outputs go by. ``counted`` wraps ``AsyncLLM.generate``, which
    vLLM's serving layer calls once per generation (one per prompt of a batched completion)
    under the request ids Forge aborts by; ``open`` starts a stream's count under those ids.
    A generation nobody opened a count for passes through untouched.
    """

    def __init__(self) -> None:
        self._open: dict[str, StreamCount] = {}  # by vLLM request id

    @contextlib.contextmanager
    def open(self, vllm_ids: list[str], kind: Kind) -> Iterator[StreamCount]:
        """A count of the stream served under ``vllm_ids``, kept until the stream ends."""
        count = StreamCount(vllm_ids, encoder_prompt=kind == "chat")
        for vllm_id in vllm_ids:
            self._open[vllm_id] = count
        try:
            yield count
        finally:
            for vllm_id in vllm_ids:
                if self._open.get(vllm_id) is count:
                    del self._open[vllm_id]

    def counted(self, generate: Callable[..., AsyncIterator]) -> Callable[..., AsyncIterator]:
        """``generate`` (``AsyncLLM.generate``'s signature), counting what it yields.

        A plain function, not an async generator: a generation counts as started when the
        serving layer asks for it, which it does for every prompt before it streams anything.
        """

        def generate_counted(prompt, sampling_params, request_id, *args, **kwargs):
            count = self._open.get(request_id)
            if count is not None:
                _every_output(sampling_params, count)
            outputs = generate(prompt, sampling_params, request_id, *args, **kwargs)
            if count is None:
                return outputs
            count.started(request_id)
            kind = getattr(getattr(sampling_params, "output_kind", None), "name", "DELTA")
            return _counting(outputs, count, request_id, cumulative=kind != "DELTA")

        return generate_counted


class StreamCount:
    """One stream's usage so far, counted from vLLM's ``RequestOutput`` as its serving layer
    counts it for the stream's final usage chunk (``chat_completion_stream_generator``,
    ``completion_stream_generator``): prompt tokens per generation (the encoder's too, for a
    chat), generated tokens summed over the generations and their ``n`` choices, cached tokens
    as the first output says. The prompt counts once its first output has come, as
    ``vllm:prompt_tokens_total`` does: an abort while queued cost nothing.

    Exact to what vLLM handed the stream; tokens vLLM merged into an output the stream had not
    yet taken when it was aborted are dropped with that output, by vLLM, and not counted.
    """

    def __init__(self, vllm_ids: list[str], encoder_prompt: bool) -> None:
        self.unstarted = set(vllm_ids)
        self.encoder_prompt = encoder_prompt
        self.broken = False
        self.blind = False  # it sees a generation's final output only (``_every_output``)
        self._prompt_tokens: dict[str, int] = {}
        self._completion_tokens: dict[tuple[str, int], int] = {}
        self._cached_tokens: int | None = None  # None until the first output

    def started(self, vllm_id: str) -> None:
        self.unstarted.discard(vllm_id)

    def add(self, vllm_id: str, output: Any, cumulative: bool) -> None:
        """One ``RequestOutput``: deltas add up (vLLM streams ``RequestOutputKind.DELTA``); a
        cumulative output replaces its choice's count."""
        if self._cached_tokens is None:
            self._cached_tokens = output.num_cached_tokens or 0
        if output.prompt_token_ids is not None:
            prompt = len(output.prompt_token_ids)
            encoder = getattr(output, "encoder_prompt_token_ids", None)
            if self.encoder_prompt and encoder is not None:
                prompt += len(encoder)
            self._prompt_tokens[vllm_id] = prompt
        for choice in output.outputs:
            key = (vllm_id, choice.index)
            tokens = len(choice.token_ids)
            self._completion_tokens[key] = tokens + (
                0 if cumulative else self._completion_tokens.get(key, 0)
            )

    def usage(self) -> Usage | None:
        """The count, or None if it cannot be trusted: a generation never started under the
        ids Forge expected (a vLLM that names them otherwise; beam search), counting failed, or
        it sees only final outputs."""
        if self.unstarted or self.broken or self.blind:
            return None
        return Usage(
            prompt_tokens=sum(self._prompt_tokens.values()),
            completion_tokens=sum(self._completion_tokens.values()),
            cached_tokens=self._cached_tokens or 0,
        )


def _every_output(sampling_params: Any, count: StreamCount) -> None:
    """A non-streamed generation's outputs, one a step, so an abort is counted.

    vLLM's serving layer asks only for the final output of a non-streamed request
    (``FINAL_ONLY``), so one aborted mid-way has shown nothing of what it cost. Asked for
    cumulative outputs instead, it takes the last one as it would the final one (its full
    generators keep the last output they see). Not with ``n`` > 1: vLLM then sends each choice
    apart, and the last output would hold one choice; such a count cannot be trusted once
    aborted (the gateway charges its estimate, flagged as such).
    """
    kind = getattr(sampling_params, "output_kind", None)
    if getattr(kind, "name", None) != "FINAL_ONLY":
        return
    if getattr(sampling_params, "n", 1) == 1:
        sampling_params.output_kind = type(kind)["CUMULATIVE"]
    else:
        count.blind = True


async def _counting(
    outputs: AsyncIterator, count: StreamCount, vllm_id: str, cumulative: bool
) -> AsyncIterator:
    """``outputs``, each counted before it is passed on. Closed with it (vLLM aborts a closed
    generation at once); a count that fails marks itself broken but never breaks the stream."""
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            if not count.broken:
                try:
                    count.add(vllm_id, output, cumulative)
                except Exception:
                    count.broken = True
                    logger.exception("could not count vLLM's output for %s", vllm_id)
            yield output


def _adapter_counts(scheduler_stats: Any, name: str) -> dict[str, int]:
    """vLLM's running or waiting adapters (by its LoRA name, ``<model>:<adapter>``) by Forge's
    adapter name."""
    counts = getattr(scheduler_stats, name, None) or {}
    return {split_adapter_model(lora)[1] or lora: n for lora, n in counts.items()}


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _vllm_request_ids(kind: Kind, base_id: str, body: dict) -> list[str]:
    """The ids vLLM's serving layer gives a request's generations (what ``abort`` takes)."""
    if kind == "chat":
        return [f"chatcmpl-{base_id}"]
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return [f"cmpl-{base_id}-{i}" for i in range(len(prompt) if batch else 1)]


def _usage_of(usage: dict) -> Usage:
    details = usage.get("prompt_tokens_details") or {}
    return Usage(
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage.get("completion_tokens") or 0,
        cached_tokens=details.get("cached_tokens") or 0,
    )


def _validated(request_class: Any, payload: dict) -> Any:
    """vLLM's request model of ``payload``; a 400 for what it refuses: a field's type (pydantic),
    or a rule of its own (``check_tool_usage``, ``check_logprobs``: a ``VLLMClientError``,
    which pydantic lets through and ``vllm serve`` maps to a 400 itself)."""
    from pydantic import ValidationError
    from vllm.exceptions import VLLMClientError

    try:
        return request_class.model_validate(payload)
    except ValidationError as exc:
        raise errors.invalid_request(_first_error(exc)) from None
    except VLLMClientError as exc:
        message = exc.args[0] if exc.args else str(exc)
        raise errors.invalid_request(message, param=getattr(exc, "parameter", None)) from None


def _forge_error(status: int, message: str, param: str | None) -> Exception:
    """vLLM's client errors keep their status; its server errors are engine failures (5xx)."""
    if status >= 500:
        return EngineError(message)
    if status == 400:
        code = "context_length_exceeded" if "context length" in message else "invalid_value"
        return errors.invalid_request(message, param=param, code=code)
    return errors.ForgeError(status, message, type="invalid_request_error", param=param)


def _error_response_for(serving, exc: Exception):
    """vLLM's own mapping of an exception to an error response; unknown ones are 5xx."""
    try:
        return serving.create_error_response(exc)
    except Exception:
        raise EngineError(f"{type(exc).__name__}: {exc}") from exc


def _stream_error_message(frame: str) -> str:
    try:
        return orjson.loads(frame[6:])["error"]["message"]
    except Exception:
        return frame[6:].strip()


def _first_error(exc) -> str:
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]
