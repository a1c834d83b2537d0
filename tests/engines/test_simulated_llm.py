"""SimulatedLLM: batching, prefix cache, determinism, abort. Ordering and counts, not wall time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from serve_app import tokenizer
from serve_app.engines.base import EngineError
from serve_app.engines.simulated_llm import SimulatedLLM, SimulatedLLMConfig, TokenOutput

REPO_ROOT = Path(__file__).resolve().parents[2]

EngineFactory = Callable[..., SimulatedLLM]


@pytest.fixture
async def make_engine() -> AsyncIterator[EngineFactory]:
    """Build engines that are closed after the test, so no loop task outlives its event loop."""
    engines: list[SimulatedLLM] = []

    def make(slow_factor: float = 1.0, **config: float) -> SimulatedLLM:
        engine = SimulatedLLM(SimulatedLLMConfig(**config), slow_factor=slow_factor)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.close()


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


async def collect(
    engine: SimulatedLLM, request_id: str, ids: list[int], max_tokens: int = 64, **kw: str
) -> list[TokenOutput]:
    return [out async for out in engine.generate(request_id, ids, max_tokens, **kw)]


async def wait_until(condition: Callable[[], bool], timeout: float = 2.0) -> None:  # noqa: ASYNC109
    """Yield to the loop until condition holds; bounded so a bug fails instead of hanging."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition never became true"
        await asyncio.sleep(0)


async def test_batching_caps_running_and_queues_the_rest(make_engine: EngineFactory) -> None:
    engine = make_engine(
        max_num_seqs=2, decode_base_s=0.001, output_tokens_min=5, output_tokens_max=5
    )
    peak_running = 0

    async def consume(i: int) -> int:
        nonlocal peak_running
        count = 0
        async for _ in engine.generate(f"r{i}", prompt(10, start=100 * i), 100):
            peak_running = max(peak_running, engine.num_requests_running)
            count += 1
        return count

    tasks = [asyncio.create_task(consume(i)) for i in range(5)]
    await wait_until(lambda: engine.num_requests_waiting == 3)
    assert engine.num_requests_running == 2
    assert await asyncio.gather(*tasks) == [5] * 5
    assert peak_running == 2
    assert (engine.num_requests_running, engine.num_requests_waiting) == (0, 0)


async def test_requests_wait_for_kv_blocks_even_with_free_slots(make_engine: EngineFactory) -> None:
    # Each request needs 3 blocks (9 prompt + 3 output tokens at 4 per block); only 4 exist.
    engine = make_engine(
        max_num_seqs=4,
        block_size=4,
        num_kv_blocks=4,
        decode_base_s=0.001,
        output_tokens_min=3,
        output_tokens_max=3,
    )
    tasks = [asyncio.create_task(collect(engine, f"r{i}", prompt(9, 50 * i), 3)) for i in range(2)]
    await wait_until(lambda: engine.num_requests_waiting == 1)
    assert engine.num_requests_running == 1
    assert [len(t) for t in await asyncio.gather(*tasks)] == [3, 3]


async def test_output_is_deterministic_and_depends_on_the_prompt(
    make_engine: EngineFactory,
) -> None:
    engine, other = make_engine(), make_engine()
    first = await collect(engine, "a", prompt(20))
    again = await collect(other, "a", prompt(20))
    different = await collect(engine, "b", prompt(20, start=7))
    seeded = await collect(engine, "c", prompt(20), seed_text="seed")

    assert [(o.token_ids, o.text) for o in first] == [(o.token_ids, o.text) for o in again]
    assert [o.text for o in first] != [o.text for o in different]
    assert [o.text for o in first] != [o.text for o in seeded]
    assert 16 <= len(first) <= 64
    assert [o.index for o in first] == list(range(len(first)))
    assert [o.finish_reason for o in first] == [None] * (len(first) - 1) + ["stop"]
    for out in first:
        assert out.text in tokenizer.OUTPUT_WORDS
        assert out.token_ids == (tokenizer.token_id(out.text),)  # a consumer keeping up


async def test_output_is_the_same_in_another_process(make_engine: EngineFactory) -> None:
    script = (
        "import asyncio\n"
        "from serve_app.engines.simulated_llm import SimulatedLLM, SimulatedLLMConfig\n"
        "async def main():\n"
        "    e = SimulatedLLM(SimulatedLLMConfig())\n"
        "    print(''.join([o.text async for o in e.generate('x', list(range(20)), 1000)]))\n"
        "    await e.close()\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, env=env, stdout=asyncio.subprocess.PIPE
    )
    stdout, _ = await proc.communicate()
    assert proc.returncode == 0
    here = "".join(o.text for o in await collect(make_engine(), "x", prompt(20)))
    assert stdout.decode().rstrip("\n") == here


async def test_max_tokens_cuts_with_length_and_exact_count(make_engine: EngineFactory) -> None:
    engine = make_engine(output_tokens_min=10, output_tokens_max=10)
    cut = await collect(engine, "a", prompt(5), max_tokens=3)
    exact = await collect(engine, "b", prompt(5), max_tokens=10)
    roomy = await collect(engine, "c", prompt(5), max_tokens=50)

    assert [o.finish_reason for o in cut] == [None, None, "length"]
    assert (len(exact), exact[-1].finish_reason) == (10, "stop")
    assert (len(roomy), roomy[-1].finish_reason) == (10, "stop")
    assert [o.text for o in cut] == [o.text for o in roomy[:3]]  # cutting never changes text


async def test_repeated_prompt_hits_the_prefix_cache(make_engine: EngineFactory) -> None:
    engine = make_engine(block_size=4)
    ids = prompt(18)  # 4 full blocks + 2 tokens

    first = await collect(engine, "a", ids)
    assert (engine.prefix_cache_queries, engine.prefix_cache_hits) == (18, 0)
    assert {o.num_cached_tokens for o in first} == {0}

    second = await collect(engine, "b", ids)
    assert (engine.prefix_cache_queries, engine.prefix_cache_hits) == (36, 16)
    assert {o.num_cached_tokens for o in second} == {16}

    # A shared prefix hits only its own full blocks: the chain hash commits to the prefix.
    third = await collect(engine, "c", ids[:9] + prompt(9, start=500))
    assert third[0].num_cached_tokens == 8


async def test_fully_cached_aligned_prompt_recomputes_its_last_block(
    make_engine: EngineFactory,
) -> None:
    # vLLM recomputes at least the last prompt token to get logits, so one block fewer hits.
    engine = make_engine(block_size=4)
    await collect(engine, "a", prompt(16))
    second = await collect(engine, "b", prompt(16))
    assert second[0].num_cached_tokens == 12


async def test_lru_eviction_drops_the_oldest_prompt(make_engine: EngineFactory) -> None:
    # 9-token prompts (2 cacheable blocks) + 3 output tokens = 3 blocks each, 5 blocks in all.
    engine = make_engine(block_size=4, num_kv_blocks=5, output_tokens_min=3, output_tokens_max=3)
    a, b, c = prompt(9, 0), prompt(9, 100), prompt(9, 200)
    for i, ids in enumerate((a, b, c)):
        assert (await collect(engine, f"first{i}", ids, 3))[0].num_cached_tokens == 0

    assert (await collect(engine, "b-again", b, 3))[0].num_cached_tokens == 8
    assert (await collect(engine, "a-again", a, 3))[0].num_cached_tokens == 0


async def test_a_consumer_that_falls_behind_gets_one_merged_output_and_never_pauses_the_engine(
    make_engine: EngineFactory,
) -> None:
    """As vLLM's ``RequestOutputCollector`` does: the engine does not wait for a slow consumer,
    and what it holds for one is the tokens not taken yet, merged into one output."""
    engine = make_engine(output_tokens_min=40, output_tokens_max=40)
    fast = await collect(make_engine(output_tokens_min=40, output_tokens_max=40), "a", prompt(10))
    stream = engine.generate("a", prompt(10), 64)
    first = await anext(stream)
    # Nobody reads: the generation runs to its end all the same, and frees its slot.
    await wait_until(lambda: engine.num_requests_running == 0)
    assert engine.generation_tokens == 40
    (rest,) = [out async for out in stream]
    assert (first.num_tokens, first.index, rest.num_tokens, rest.index) == (1, 0, 39, 1)
    assert rest.finish_reason == "stop"
    assert first.text + rest.text == "".join(out.text for out in fast)
    assert first.token_ids + rest.token_ids == tuple(i for out in fast for i in out.token_ids)


async def test_abort_frees_the_slot_and_admits_the_next(make_engine: EngineFactory) -> None:
    engine = make_engine(
        max_num_seqs=1, decode_base_s=0.001, output_tokens_min=50, output_tokens_max=50
    )
    seen: list[TokenOutput] = []

    async def consume_a() -> None:
        async for out in engine.generate("a", prompt(10), 100):
            seen.append(out)

    task_a = asyncio.create_task(consume_a())
    task_b = asyncio.create_task(collect(engine, "b", prompt(10, start=100)))
    await wait_until(lambda: len(seen) >= 2 and engine.num_requests_waiting == 1)

    engine.abort("a")
    assert (engine.num_requests_running, engine.num_requests_waiting) == (0, 1)
    await task_a  # the stream just ends
    assert 2 <= len(seen) < 50
    assert seen[-1].finish_reason is None
    assert len(await task_b) == 50
    engine.abort("a")  # unknown / finished ids are ignored
    engine.abort("nope")


async def test_abort_of_a_waiting_request_dequeues_it(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_seqs=1, decode_base_s=0.001)
    task_a = asyncio.create_task(collect(engine, "a", prompt(10)))
    task_b = asyncio.create_task(collect(engine, "b", prompt(10, start=100)))
    await wait_until(lambda: engine.num_requests_waiting == 1)
    engine.abort("b")
    assert engine.num_requests_waiting == 0
    assert await task_b == []
    assert len(await task_a) >= 16


async def test_closing_the_stream_frees_the_slot_at_once(make_engine: EngineFactory) -> None:
    engine = make_engine(
        max_num_seqs=1, decode_base_s=0.001, output_tokens_min=50, output_tokens_max=50
    )
    waiting = asyncio.create_task(collect(engine, "b", prompt(10, start=100)))
    async with contextlib.aclosing(engine.generate("a", prompt(10), 100)) as stream:
        async for out in stream:
            if out.index == 1:
                break
    assert engine.num_requests_running == 0
    assert engine.kv_cache_usage() == 0.0
    assert len(await waiting) == 50


async def test_breaking_out_without_aclose_frees_the_slot_soon(make_engine: EngineFactory) -> None:
    # Without aclosing(), Python finalises the abandoned generator on a later loop tick.
    engine = make_engine(max_num_seqs=1, output_tokens_min=50, output_tokens_max=50)
    async for _ in engine.generate("a", prompt(10), 100):
        break
    await wait_until(lambda: engine.num_requests_running == 0)


async def test_cancelling_the_consumer_frees_the_slot(make_engine: EngineFactory) -> None:
    engine = make_engine(
        max_num_seqs=1, decode_base_s=0.001, output_tokens_min=50, output_tokens_max=50
    )
    first_token = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("a", prompt(10), 100):
            first_token.set()

    task_a = asyncio.create_task(consume())
    task_b = asyncio.create_task(collect(engine, "b", prompt(10, start=100)))
    await first_token.wait()
    await wait_until(lambda: engine.num_requests_waiting == 1)
    task_a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task_a
    assert engine.num_requests_running + engine.num_requests_waiting == 1  # only "b" is left
    assert len(await task_b) == 50


async def test_kv_cache_usage_rises_while_running_and_returns_to_zero(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(
        block_size=4, num_kv_blocks=100, output_tokens_min=20, output_tokens_max=20
    )
    assert engine.kv_cache_usage() == 0.0
    usage = [engine.kv_cache_usage() async for out in engine.generate("a", prompt(18), 100)]
    # The last sample is taken after the request finished and released its blocks.
    assert usage[-1] == 0.0
    running = usage[:-1]
    assert running[0] >= 5 / 100  # 18 prompt tokens + the first token's slot
    assert running == sorted(running) and running[-1] > running[0]  # decode takes blocks
    assert engine.kv_cache_usage() == 0.0
    # The blocks stay cached though: evictable cache is not "usage".
    assert (await collect(engine, "b", prompt(18)))[0].num_cached_tokens == 16


async def test_slow_factor_and_prefix_cache_shape_time_to_first_token(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(prefill_per_token_s=0.0001, output_tokens_min=1, output_tokens_max=1)
    loop = asyncio.get_running_loop()

    async def ttft(request_id: str, ids: list[int]) -> float:
        start = loop.time()
        await collect(engine, request_id, ids)
        return loop.time() - start

    fast = await ttft("fast", prompt(100, start=0))
    engine.slow_factor = 4.0
    slow = await ttft("slow", prompt(100, start=1000))
    assert slow > fast

    engine.slow_factor = 1.0
    cold = await ttft("cold", prompt(200, start=5000))
    warm = await ttft("warm", prompt(200, start=5000))  # 192 of 200 tokens cached
    assert warm < cold

    with pytest.raises(ValueError, match="slow_factor"):
        engine.slow_factor = -1


async def test_impossible_or_malformed_requests_raise_at_call_time(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(block_size=16, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.generate("a", prompt(60), max_tokens=10)  # 70 tokens > 64 slots
    with pytest.raises(ValueError, match="empty"):
        engine.generate("b", [], max_tokens=10)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate("c", prompt(4), max_tokens=0)
    assert len(await collect(engine, "d", prompt(40), max_tokens=24)) <= 24  # exactly fits


async def test_duplicate_request_id_is_rejected(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_seqs=1, decode_base_s=0.001)
    task = asyncio.create_task(collect(engine, "same", prompt(10)))
    await wait_until(lambda: engine.num_requests_running == 1)
    with pytest.raises(ValueError, match="already in flight"):
        await collect(engine, "same", prompt(10))
    assert len(await task) >= 16


async def test_loop_idles_instead_of_spinning(make_engine: EngineFactory) -> None:
    engine = make_engine(output_tokens_min=3, output_tokens_max=3)
    await collect(engine, "a", prompt(10))
    steps = engine._steps
    assert steps == 3
    for _ in range(100):
        await asyncio.sleep(0)
    assert engine._steps == steps


async def test_close_ends_open_streams_and_refuses_new_ones(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_seqs=1, decode_base_s=0.001)
    running = asyncio.create_task(collect(engine, "a", prompt(10)))
    waiting = asyncio.create_task(collect(engine, "b", prompt(10, start=100)))
    await wait_until(lambda: engine.num_requests_waiting == 1)
    await engine.close()
    assert await waiting == []
    assert len(await running) < 16
    with pytest.raises(EngineError):
        await collect(engine, "c", prompt(10))


async def test_mixed_load_with_aborts_leaves_a_consistent_pool(make_engine: EngineFactory) -> None:
    """Shared prefixes, a tight cache, cancellations: every block comes back, counts stay exact."""
    engine = make_engine(
        max_num_seqs=4, block_size=4, num_kv_blocks=40, output_tokens_min=1, output_tokens_max=12
    )
    rng = random.Random(0)
    prefixes = [prompt(12, start=1000 * i) for i in range(4)]

    async def one(i: int) -> tuple[int, TokenOutput]:
        ids = rng.choice(prefixes) + prompt(rng.randint(1, 9), start=50_000 + i)
        max_tokens = rng.randint(1, 12)
        outs: list[TokenOutput] = []
        async for out in engine.generate(f"r{i}", ids, max_tokens):
            outs.append(out)
            assert engine.num_requests_running <= 4
            assert 0.0 <= engine.kv_cache_usage() <= 1.0
        return max_tokens, outs[-1]

    tasks = [asyncio.create_task(one(i)) for i in range(150)]
    doomed = rng.sample(tasks, 30)
    for n, task in enumerate(doomed):
        if n % 2:  # half of them mid-flight, running or queued
            await asyncio.sleep(0)
        task.cancel()
    finished = 0
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, asyncio.CancelledError):
            continue
        max_tokens, last = result
        finished += 1
        assert last.index + 1 <= max_tokens
        assert last.finish_reason == "stop" or last.index + 1 == max_tokens
    assert finished >= 120
    pool = engine._pool
    assert (engine.num_requests_running, engine.num_requests_waiting) == (0, 0)
    assert engine.kv_cache_usage() == 0.0
    assert pool._num_reserved == pool._num_anonymous == 0
    assert set(pool._refs.values()) <= {0} and len(pool._evictable) == len(pool._refs)
    assert engine.prefix_cache_hits > 0


def test_config_rejects_bad_values_naming_the_field() -> None:
    with pytest.raises(ValueError, match="block_size"):
        SimulatedLLMConfig(block_size=0)
    with pytest.raises(ValueError, match="decode_base_s"):
        SimulatedLLMConfig(decode_base_s=-1)
    with pytest.raises(ValueError, match="output_tokens_max"):
        SimulatedLLMConfig(output_tokens_min=10, output_tokens_max=5)


# -- chunked prefill ---------------------------------------------------------------------------


async def test_a_long_prefill_is_chunked_to_the_step_budget(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_batched_tokens=256, output_tokens_min=1, output_tokens_max=1)
    await collect(engine, "long", prompt(1000))
    assert engine._steps == 4  # ceil(1000 / 256) steps, the first token at the end of the last


async def test_decodes_keep_flowing_while_a_long_prompt_prefills(
    make_engine: EngineFactory,
) -> None:
    # The point of chunked prefill in vLLM: a 2,000-token prefill no longer stalls the running
    # sequences for one long step; each 256-token step also gives them a token.
    engine = make_engine(max_num_batched_tokens=256, output_tokens_min=40, output_tokens_max=40)
    tokens: list[int] = []

    async def decode() -> None:
        async for out in engine.generate("decoding", prompt(4, start=9000), 40):
            tokens.append(out.index)

    decoding = asyncio.create_task(decode())
    await wait_until(lambda: len(tokens) >= 1)
    before = len(tokens)
    await anext(engine.generate("long", prompt(2000), 1))
    assert len(tokens) - before >= 7  # ceil(2000 / 255) = 8 steps, a decode token in each
    decoding.cancel()
    await asyncio.gather(decoding, return_exceptions=True)


async def test_a_short_request_fills_the_budget_a_last_chunk_leaves(
    make_engine: EngineFactory,
) -> None:
    # As vLLM schedules: a prefill under way takes the budget first; a request that arrives
    # meanwhile is admitted in the step whose chunk leaves room, and both finish in it.
    engine = make_engine(max_num_batched_tokens=256, output_tokens_min=1, output_tokens_max=1)
    long = asyncio.create_task(collect(engine, "long", prompt(600)))
    await wait_until(lambda: engine.num_requests_running == 1)
    short = await collect(engine, "short", prompt(20, start=9000))
    await long
    assert short[0].index == 0 and engine._steps == 3  # 256 + 256 + (88 + 20)


async def test_decodes_take_budget_before_prefill_chunks(make_engine: EngineFactory) -> None:
    # Budget 8 with 4 decoding requests leaves 4 tokens a step for the new prompt's prefill.
    engine = make_engine(
        max_num_seqs=5, max_num_batched_tokens=8, output_tokens_min=40, output_tokens_max=40
    )
    decoding = [
        asyncio.create_task(collect(engine, f"d{i}", prompt(2, start=100 * i))) for i in range(4)
    ]
    await wait_until(lambda: engine.num_requests_running == 4 and engine._steps >= 2)
    steps_before = engine._steps
    first = engine.generate("new", prompt(20, start=7000), 1)
    await anext(first)
    assert 5 <= engine._steps - steps_before <= 6  # 20 tokens, 4 a step (+ the step under way)
    await first.aclose()
    for task in decoding:
        task.cancel()
    await asyncio.gather(*decoding, return_exceptions=True)


def test_config_requires_a_budget_that_fits_a_full_batch_of_decodes() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SimulatedLLMConfig(max_num_seqs=8, max_num_batched_tokens=4)


# -- KV events ---------------------------------------------------------------------------------


class RecordingPublisher:
    """Records what the engine publishes, in the order it publishes it."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, object]] = []
        self.loads: list = []

    def stored(self, hashes) -> None:
        self.ops.append(("stored", list(hashes)))

    def removed(self, hashes) -> None:
        self.ops.append(("removed", list(hashes)))

    def cleared(self) -> None:
        self.ops.append(("cleared", None))

    def accepted(self, request_id: str) -> None:
        self.ops.append(("accepted", request_id))

    def flush(self, load) -> None:
        self.loads.append(load)


async def test_events_name_every_block_cached_and_evicted(make_engine: EngineFactory) -> None:
    from serve_app.kvcache.block_hashes import prefix_block_hashes

    engine = make_engine(block_size=4, num_kv_blocks=5, output_tokens_min=3, output_tokens_max=3)
    events = engine.events = RecordingPublisher()
    a, b = prompt(9, 0), prompt(9, 100)
    await collect(engine, "a", a, 3)
    assert events.ops == [("accepted", "a"), ("stored", list(prefix_block_hashes(a, 4)))]
    events.ops.clear()
    await collect(engine, "b", b, 3)
    await collect(engine, "a2", prompt(9, 200), 3)  # 5 blocks: a's are evicted for it
    stored = [h for kind, hs in events.ops if kind == "stored" for h in hs]
    removed = [h for kind, hs in events.ops if kind == "removed" for h in hs]
    assert set(removed) <= set(prefix_block_hashes(a, 4)) and removed
    # What the events say is cached is exactly what the engine holds.
    held = set(prefix_block_hashes(a, 4)) | set(stored)
    assert held - set(removed) == set(engine.cached_block_hashes())
    assert events.loads[-1].running == 0 and events.loads[-1].backlog == 0


async def test_backlog_counts_the_uncached_tokens_queued(make_engine: EngineFactory) -> None:
    engine = make_engine(
        max_num_seqs=1,
        block_size=4,
        decode_base_s=0.001,
        output_tokens_min=50,
        output_tokens_max=50,
    )
    await collect(engine, "warm", prompt(40), 1)  # caches 9 blocks of this prompt
    busy = asyncio.create_task(collect(engine, "busy", prompt(10, start=500)))
    await wait_until(lambda: engine.num_requests_running == 1)
    queued = engine.generate("queued", prompt(40) + prompt(20, start=900), 1)
    waiter = asyncio.create_task(anext(queued))
    await wait_until(lambda: engine.num_requests_waiting == 1)
    assert engine.prefill_backlog() == 60 - 40  # 10 blocks of 4 cached, 20 tokens to go
    waiter.cancel()
    busy.cancel()
    await asyncio.gather(waiter, busy, return_exceptions=True)
    await queued.aclose()


# -- LoRA adapters ---------------------------------------------------------------------------


async def test_an_adapters_answer_is_its_own_and_the_same_every_time(make_engine) -> None:
    engine = make_engine(output_tokens_min=8, output_tokens_max=8)
    ids = prompt(40)

    async def text(request_id: str, adapter: str | None) -> str:
        return "".join(o.text for o in await collect(engine, request_id, ids, adapter=adapter))

    base, support, legal = (
        await text("b", None),
        await text("s", "support"),
        await text("l", "legal"),
    )
    assert len({base, support, legal}) == 3
    assert await text("s2", "support") == support


async def test_an_adapters_prefix_cache_is_not_the_base_models(make_engine) -> None:
    engine = make_engine(block_size=4, output_tokens_min=1, output_tokens_max=1)
    ids = prompt(33)
    await collect(engine, "base", ids)
    (first,) = await collect(engine, "support", ids, adapter="support")
    (again,) = await collect(engine, "support-2", ids, adapter="support")
    assert first.num_cached_tokens == 0  # vLLM keys a block by its LoRA too
    assert again.num_cached_tokens == 32


async def test_adapter_slots_load_evict_and_never_mix_more_adapters_than_slots(make_engine) -> None:
    engine = make_engine(max_loras=1, decode_base_s=0.001, output_tokens_min=4, output_tokens_max=4)
    seen: list[dict[str, int]] = []

    async def watch() -> None:
        while True:
            seen.append(engine.running_adapters())
            await asyncio.sleep(0)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(
            *(collect(engine, f"r{i}", prompt(8, i), adapter=a) for i, a in enumerate("xyxy"))
        )
    finally:
        watcher.cancel()
    assert all(len(running) <= 1 for running in seen)  # one slot: one adapter at a time
    assert {a for running in seen for a in running} == {"x", "y"}
    # x loads; the second x joins the first past the waiting y (as vLLM skips y); then y
    # loads once x is idle, and both y's run on it: two loads, not four.
    assert engine.adapter_loads == 2
    assert engine.resident_adapters() == ["y"]


async def test_a_request_whose_adapter_has_no_slot_lets_the_next_one_go_first(make_engine) -> None:
    engine = make_engine(
        max_loras=1, max_num_seqs=4, decode_base_s=0.001, output_tokens_min=6, output_tokens_max=6
    )
    order: list[str] = []

    async def run(request_id: str, adapter: str | None) -> None:
        async for _ in engine.generate(request_id, prompt(8), 6, adapter=adapter):
            if request_id not in order:
                order.append(request_id)

    await asyncio.gather(run("x", "x"), run("y", "y"), run("base", None))
    # "y" waits for x's slot; the base model's request behind it does not wait with it.
    assert order.index("base") < order.index("y")
