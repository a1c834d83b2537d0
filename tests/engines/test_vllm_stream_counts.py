"""What an abandoned stream (or non-streamed generation) on the vLLM engine cost, without vLLM.

``StreamCounts`` counts vLLM's ``RequestOutput`` on their way from ``AsyncLLM.generate`` to
vLLM's serving layer; ``VLLMEngine.stream`` records the count of a stream that ends without
yielding its ``Usage``. The stand-ins here carry the fields of vLLM's ``RequestOutput`` and
``CompletionOutput`` that the count reads, and ``FakeAsyncLLM`` streams them as vLLM does for a
stream (deltas, one token a step; closing or cancelling the stream aborts the request). The
engine's own ``stream`` runs over it and over a stand-in for vLLM's chat stream generator.
``tests/engines/contract.py`` and ``tests/vllm/test_vllm_engine.py`` check the same on the real
vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import orjson
import pytest

from serve_app.engines.base import AbandonedUsage, Usage
from serve_app.engines.vllm_engine import StreamCounts, VLLMEngine, _vllm_request_ids

PROMPT_TOKENS = 7
CACHED_TOKENS = 4
DELTA = SimpleNamespace(output_kind=SimpleNamespace(name="DELTA"))  # vLLM's streaming params
CUMULATIVE = SimpleNamespace(output_kind=SimpleNamespace(name="CUMULATIVE"))


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    encoder_prompt_token_ids: list[int] | None = None


@dataclass
class FakeAsyncLLM:
    """``AsyncLLM`` as vLLM's serving layer drives it: ``generate`` streams one token per step
    for each of ``n`` choices; once ``hold_after`` tokens are out it waits (a slow engine step)
    until ``release`` is set. Closing or cancelling a generation aborts it, as vLLM's does."""

    max_tokens: int = 50
    n: int = 1
    hold_after: int | None = None
    release: asyncio.Event = field(default_factory=asyncio.Event)
    held: asyncio.Event = field(default_factory=asyncio.Event)  # set while it waits
    generated: int = 0  # tokens yielded, every generation together
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        try:
            for step in range(self.max_tokens):
                if step == self.hold_after:
                    self.held.set()
                    await self.release.wait()
                await asyncio.sleep(0)
                last = step == self.max_tokens - 1
                self.generated += self.n
                yield RequestOutput(
                    request_id,
                    list(range(PROMPT_TOKENS)),
                    [
                        CompletionOutput(i, [step], "length" if last else None)
                        for i in range(self.n)
                    ],
                    finished=last,
                    num_cached_tokens=CACHED_TOKENS,
                )
            self.finished.append(request_id)
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request_id)
            raise

    async def abort(self, vllm_ids: list[str]) -> None:
        self.aborted.extend(vllm_ids)


async def chat_frames(
    outputs: AsyncIterator, before_done: asyncio.Event, at_done: asyncio.Event
) -> AsyncIterator[str]:
    """vLLM's chat stream generator as far as Forge reads it: a role chunk first, a chunk per
    output, the usage chunk (counted from the outputs as vLLM counts it), then ``[DONE]`` once
    ``before_done`` is set (``at_done`` says it is waiting for that)."""
    prompt = completion = 0
    cached = None
    first = True
    async for res in outputs:
        prompt = len(res.prompt_token_ids)
        if first:
            cached, first = res.num_cached_tokens, False
            yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for out in res.outputs:
            completion += len(out.token_ids)
            delta = {"index": out.index, "delta": {"content": "x"}}
            yield _sse({"choices": [delta | {"finish_reason": out.finish_reason}]})
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    yield _sse({"choices": [], "usage": usage})
    at_done.set()
    await before_done.wait()
    yield "data: [DONE]\n\n"


def _sse(chunk: dict) -> str:
    return f"data: {orjson.dumps({'id': 'chatcmpl-x', **chunk}).decode()}\n\n"


class EngineOverFakes(VLLMEngine):
    """``VLLMEngine``'s own ``stream`` over ``FakeAsyncLLM`` and ``chat_frames`` (no vLLM):
    ``_request`` and ``_serve``, the two methods that need vLLM, are stood in for."""

    def __init__(self, llm: FakeAsyncLLM) -> None:
        self.model = "fake-model"
        self.default_max_tokens = 16
        self._serial = 0
        self.abandoned = AbandonedUsage()
        self._counts = StreamCounts()
        self.llm = llm
        self.llm.generate = self._counts.counted(self.llm.generate)  # as VLLMEngine.__init__
        self.before_done = asyncio.Event()
        self.before_done.set()
        self.at_done = asyncio.Event()

    def _request(self, body, kind, request_id, stream):
        self._serial += 1
        base_id = f"{request_id}-{self._serial}"
        return base_id, _vllm_request_ids(kind, base_id, body)

    async def _serve(self, request, kind):
        # vLLM's serving layer asks for the generation before it returns its stream.
        outputs = self.llm.generate({"prompt_token_ids": []}, DELTA, f"chatcmpl-{request}")
        return chat_frames(outputs, self.before_done, self.at_done)


BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def nothing_to_collect(engine: VLLMEngine, request_id: str) -> bool:
    return await engine.abandoned.collect(request_id, 0.05) is None


# -- VLLMEngine.stream ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 10])
async def test_a_stream_closed_after_k_outputs_records_its_prompt_and_k_tokens(k):
    engine = EngineOverFakes(FakeAsyncLLM())
    stream = engine.stream(BODY, "chat", "req-left")
    for _ in range(1 + k):  # the role chunk, then one chunk per output
        await anext(stream)

    await stream.aclose()  # what the replica does when the gateway's caller goes away

    usage = await engine.abandoned.collect("req-left", 0.05)
    assert usage == Usage(PROMPT_TOKENS, k, CACHED_TOKENS)
    assert engine.llm.aborted  # and vLLM was told
    assert await nothing_to_collect(engine, "req-left")  # collected once


async def test_a_cancelled_consumer_records_exactly_what_vllm_handed_the_stream():
    """The replica cancels its producer task: the cancellation lands inside vLLM's generate,
    waiting on an engine step, after it has handed over ``k`` outputs."""
    k = 4
    engine = EngineOverFakes(FakeAsyncLLM(hold_after=k))
    items: list = []

    async def produce() -> None:
        async for item in engine.stream(BODY, "chat", "req-cancelled"):
            items.append(item)

    task = asyncio.create_task(produce())
    await asyncio.wait_for(engine.llm.held.wait(), 5)  # parked in vLLM, not between frames
    assert len(items) == 1 + k
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

    assert await engine.abandoned.collect("req-cancelled", 0.05) == Usage(
        PROMPT_TOKENS, k, CACHED_TOKENS
    )
    assert engine.llm.generated == k


async def test_a_stream_read_to_its_end_records_nothing():
    engine = EngineOverFakes(FakeAsyncLLM(max_tokens=5))

    items = [item async for item in engine.stream(BODY, "chat", "req-read")]

    assert items[-1] == Usage(PROMPT_TOKENS, 5, CACHED_TOKENS)  # the replica's to deliver
    assert engine.llm.finished and not engine.llm.aborted
    assert await nothing_to_collect(engine, "req-read")


async def test_a_stream_left_after_vllms_usage_chunk_records_that_usage_once():
    """The generation finished and vLLM counted it, but the stream was cancelled before its
    ``Usage`` reached the replica (waiting for vLLM's ``[DONE]``): the replica never has that
    ``Usage`` to record, so the engine records it, and nothing else."""
    engine = EngineOverFakes(FakeAsyncLLM(max_tokens=5))
    engine.before_done.clear()
    items: list = []

    async def produce() -> None:
        async for item in engine.stream(BODY, "chat", "req-at-done"):
            items.append(item)

    task = asyncio.create_task(produce())
    await asyncio.wait_for(engine.at_done.wait(), 5)  # past the usage chunk, before [DONE]
    assert engine.llm.finished
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

    assert not any(isinstance(item, Usage) for item in items)
    assert await engine.abandoned.collect("req-at-done", 0.05) == Usage(
        PROMPT_TOKENS, 5, CACHED_TOKENS
    )
    assert await nothing_to_collect(engine, "req-at-done")


async def test_a_stream_whose_generation_vllm_never_started_records_nothing():
    """Its count would be zero for a request that did run (vLLM named it otherwise): the
    engine cannot say, and the gateway's estimate is the honest answer."""
    engine = EngineOverFakes(FakeAsyncLLM())

    async def renamed(request, kind):
        outputs = engine.llm.generate({}, DELTA, f"not-forges-id-{request}")
        return chat_frames(outputs, engine.before_done, engine.at_done)

    engine._serve = renamed
    stream = engine.stream(BODY, "chat", "req-renamed")
    for _ in range(3):
        await anext(stream)
    await stream.aclose()

    assert await nothing_to_collect(engine, "req-renamed")


# -- StreamCounts --------------------------------------------------------------------------------


async def take(outputs: AsyncIterator, k: int) -> None:
    """Read ``k`` outputs, then close the stream (what vLLM's serving layer does when closed)."""
    for _ in range(k):
        await anext(outputs)
    await outputs.aclose()


async def test_choices_and_batched_prompts_add_up_as_vllms_usage_does():
    """``n`` choices per generation and one generation per prompt of a batched completion:
    prompt tokens per generation, generated tokens over every choice of every generation."""
    counts = StreamCounts()
    llm = FakeAsyncLLM(n=2)
    generate = counts.counted(llm.generate)
    ids = ["cmpl-r-1-0", "cmpl-r-1-1"]
    with counts.open(ids, "completion") as count:
        first = generate({}, DELTA, ids[0])
        second = generate({}, DELTA, ids[1])
        await take(first, 3)
        await take(second, 5)

    assert count.usage() == Usage(2 * PROMPT_TOKENS, 2 * 3 + 2 * 5, CACHED_TOKENS)
    assert llm.aborted == ids  # closing the counted stream closed vLLM's


async def test_cumulative_outputs_replace_their_count():
    counts = StreamCounts()
    generate = counts.counted(cumulative_generate)
    with counts.open(["chatcmpl-r-1"], "chat") as count:
        await take(generate({}, CUMULATIVE, "chatcmpl-r-1"), 3)

    assert count.usage() == Usage(PROMPT_TOKENS, 3, 0)


async def cumulative_generate(prompt, sampling_params, request_id, **kwargs):
    for step in range(1, 10):
        yield RequestOutput(
            request_id, list(range(PROMPT_TOKENS)), [CompletionOutput(0, list(range(step)))], False
        )


async def test_a_chats_encoder_prompt_counts_as_vllms_chat_usage_counts_it():
    async def encoder_decoder(prompt, sampling_params, request_id, **kwargs):
        yield RequestOutput(request_id, [1, 2], [CompletionOutput(0, [9])], False, None, [3, 4, 5])

    counts = StreamCounts()
    generate = counts.counted(encoder_decoder)
    with counts.open(["chatcmpl-a"], "chat") as chat, counts.open(["cmpl-b-0"], "completion") as c:
        await take(generate({}, DELTA, "chatcmpl-a"), 1)
        await take(generate({}, DELTA, "cmpl-b-0"), 1)

    assert chat.usage() == Usage(5, 1, 0)
    assert c.usage() == Usage(2, 1, 0)  # vLLM's completion usage leaves the encoder out


async def test_an_abort_before_the_first_output_costs_nothing():
    """As in ``vllm:prompt_tokens_total``: a prompt counts once vLLM has prefilled it."""
    counts = StreamCounts()
    llm = FakeAsyncLLM(hold_after=0)
    generate = counts.counted(llm.generate)
    with counts.open(["chatcmpl-q"], "chat") as count:
        outputs = generate({}, DELTA, "chatcmpl-q")

        async def first_output():
            return await anext(outputs)

        waiting = asyncio.create_task(first_output())
        await asyncio.sleep(0)  # queued in vLLM, no step yet
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting

    assert count.usage() == Usage(0, 0, 0)
    assert llm.aborted == ["chatcmpl-q"]


async def test_a_generation_nobody_counts_passes_through_untouched():
    counts = StreamCounts()
    llm = FakeAsyncLLM()
    generate = counts.counted(llm.generate)
    with counts.open(["chatcmpl-counted"], "chat"):
        outputs = generate({}, DELTA, "chatcmpl-other")

    assert outputs.ag_code is FakeAsyncLLM.generate.__code__  # vLLM's own generator, unwrapped
    await outputs.aclose()


async def test_a_count_ends_with_its_stream():
    counts = StreamCounts()
    llm = FakeAsyncLLM()
    generate = counts.counted(llm.generate)
    with counts.open(["chatcmpl-done"], "chat"):
        pass

    outputs = generate({}, DELTA, "chatcmpl-done")
    assert outputs.ag_code is FakeAsyncLLM.generate.__code__
    await outputs.aclose()


async def test_an_output_that_cannot_be_counted_breaks_the_count_not_the_stream():
    async def unlike_vllm(prompt, sampling_params, request_id, **kwargs):
        for _ in range(3):
            yield SimpleNamespace(request_id=request_id)  # no fields the count reads

    counts = StreamCounts()
    generate = counts.counted(unlike_vllm)
    with counts.open(["chatcmpl-odd"], "chat") as count:
        seen = [output async for output in generate({}, DELTA, "chatcmpl-odd")]

    assert len(seen) == 3
    assert count.usage() is None  # unknown: the gateway estimates


# -- a non-streamed generation (vLLM's FINAL_ONLY outputs) ---------------------------------------


class OutputKind(enum.Enum):  # vLLM's RequestOutputKind, by its names
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


async def test_a_counted_final_only_generation_is_asked_for_every_output_instead():
    """vLLM shows a non-streamed generation only its final output: one aborted mid-way would
    have shown nothing. Counted, it is asked for cumulative outputs (the serving layer keeps
    the last one, as it kept the final one) and an abort after three steps costs three."""
    counts = StreamCounts()
    seen: list[str] = []

    async def generate(prompt, sampling_params, request_id, **kwargs):
        seen.append(sampling_params.output_kind.name)
        async for output in cumulative_generate(prompt, sampling_params, request_id):
            yield output

    params = SimpleNamespace(output_kind=OutputKind.FINAL_ONLY, n=1)
    with counts.open(["chatcmpl-r-1"], "chat") as count:
        await take(counts.counted(generate)({}, params, "chatcmpl-r-1"), 3)
    assert seen == ["CUMULATIVE"]
    assert count.usage() == Usage(PROMPT_TOKENS, 3, 0)
    untouched = SimpleNamespace(output_kind=OutputKind.FINAL_ONLY, n=1)
    await take(counts.counted(generate)({}, untouched, "chatcmpl-nobody"), 1)
    assert untouched.output_kind is OutputKind.FINAL_ONLY  # nobody counts it: left as asked


async def test_a_final_only_generation_of_several_choices_stays_so_and_its_count_is_unknown():
    """With ``n`` > 1 vLLM would send each choice apart and the last output would hold one
    choice: left final-only, so an abort is charged the gateway's estimate, not a guess."""
    counts = StreamCounts()
    params = SimpleNamespace(output_kind=OutputKind.FINAL_ONLY, n=2)
    with counts.open(["chatcmpl-r-1"], "chat") as count:
        await take(counts.counted(cumulative_generate)({}, params, "chatcmpl-r-1"), 1)
    assert params.output_kind is OutputKind.FINAL_ONLY
    assert count.usage() is None
