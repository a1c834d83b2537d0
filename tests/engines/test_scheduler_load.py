"""``SchedulerLoad``, the vLLM engine's tap on vLLM's scheduler updates, without vLLM.

vLLM calls ``record(scheduler_stats, iteration_stats)`` on every stat logger; the stand-ins
carry the fields of its ``SchedulerStats`` and ``IterationStats`` that the tap reads.
``tests/vllm/test_vllm_engine.py`` compares the result with vLLM's own Prometheus series.
"""

from __future__ import annotations

from types import SimpleNamespace

from serve_app.engines.vllm_engine import SchedulerLoad


def scheduler(running=0, waiting=0, kv=0.0, queries=0, hits=0, **extra) -> SimpleNamespace:
    return SimpleNamespace(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        kv_cache_usage=kv,
        prefix_cache_stats=SimpleNamespace(queries=queries, hits=hits),
        **extra,
    )


def iteration(generated=0, prompt=0) -> SimpleNamespace:
    return SimpleNamespace(num_generation_tokens=generated, num_prompt_tokens=prompt)


def test_gauges_are_the_latest_update():
    load = SchedulerLoad()

    load.record(scheduler(running=5, waiting=4, kv=0.75), None)
    load.record(scheduler(running=2, waiting=1, kv=0.25), None)

    assert (load.running, load.waiting, load.kv_cache_usage) == (2, 1, 0.25)


def test_counters_are_summed_over_updates():
    load = SchedulerLoad()

    load.record(scheduler(queries=64, hits=32), iteration(generated=3, prompt=64))
    load.record(scheduler(queries=16, hits=0), iteration(generated=5, prompt=16))
    load.record(None, iteration(generated=1))  # an iteration without a scheduler update

    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (80, 32)
    assert (load.generation_tokens, load.prompt_tokens) == (9, 80)


def test_skipped_waiting_requests_count_as_waiting():
    load = SchedulerLoad()

    load.record(scheduler(waiting=2, num_skipped_waiting_reqs=3), None)
    assert load.waiting == 5  # as vllm:num_requests_waiting counts them

    load.record(scheduler(waiting=2), None)  # a vLLM without the field
    assert load.waiting == 2


def test_each_scheduler_update_calls_on_update():
    load = SchedulerLoad()
    seen: list[int] = []
    load.on_update = lambda: seen.append(load.running)

    load.record(scheduler(running=1), None)
    load.record(None, iteration(generated=1))  # no scheduler numbers: nothing to republish
    load.record(scheduler(running=3), iteration())

    assert seen == [1, 3]  # called after the numbers were updated


def test_it_is_its_own_per_engine_logger():
    load = SchedulerLoad()

    assert load.per_engine_logger(object(), 0) is load  # vLLM's factory call: one tap
