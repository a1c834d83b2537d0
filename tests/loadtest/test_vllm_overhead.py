"""The vLLM overhead benchmark's profile arithmetic without vLLM: which part and group a py-spy
frame belongs to, and a raw record's shares."""

from __future__ import annotations

from loadtest.concurrency import profile_shares
from loadtest.vllm_overhead import _group, _vllm_part


def test_frames_are_named_by_the_part_of_the_path_they_belong_to():
    named = {
        "output_handler (vllm/v1/engine/async_llm.py:420)": (
            "vllm: async_llm.py",
            "vLLM engine client / output handler",
        ),
        "step (vllm/v1/engine/core.py:300)": (
            "vllm: engine core",
            "vLLM engine core (scheduler, model)",
        ),
        "schedule (vllm/v1/core/sched/scheduler.py:5)": (
            "vllm: engine core",
            "vLLM engine core (scheduler, model)",
        ),
        "forward (torch/nn/modules/module.py:1)": ("torch", "vLLM engine core (scheduler, model)"),
        "recv (zmq/sugar/socket.py:3)": ("zmq", "vLLM IPC (zmq, msgspec)"),
        "f (/work/main/serve_app/replica/feed.py:10)": (
            "serve_app/replica/feed.py",
            "Forge (serve_app)",
        ),
        "g (ray/serve/_private/replica.py:5)": (
            "ray.serve: replica.py",
            "Serve/Ray transport (Python)",
        ),
        "_run_once (asyncio/base_events.py:1900)": ("asyncio", "asyncio (the loop's own work)"),
        "sched_yield (vllm/distributed/utils.py:46)": (
            "vllm: spin-wait on its shm queue",
            "vLLM engine core spinning on its queue (sched_yield)",
        ),
        "Worker.main_loop (ray/_private/worker.py:1069)": (
            "native: Ray worker's main loop",
            "native threads (Ray core worker, gRPC: no Python frame)",
        ),
        "Thread.run (threading.py:982)": (
            "native: below Thread.run",
            "native threads (Ray core worker, gRPC: no Python frame)",
        ),
        "Condition.wait (threading.py:327)": ("threading", "threading (locks, waits)"),
        "Runner.run (asyncio/runners.py:118)": (
            "native: uvloop's loop",
            "uvloop's loop (native: epoll, its callbacks' C part)",
        ),
    }
    for frame, (part, group) in named.items():
        assert _vllm_part(frame) == part
        assert _group(part) == group
    assert _vllm_part("main (somewhere/else.py:1)") is None


def test_a_raw_record_splits_into_self_shares_by_the_innermost_named_part():
    raw = "\n".join(
        [
            "a (ray/serve/_private/replica.py:1);b (vllm/v1/engine/async_llm.py:2) 3",
            "a (ray/serve/_private/replica.py:1);c (/x/serve_app/replica/feed.py:3) 1",
        ]
    )
    shares = profile_shares(raw, part_of=_vllm_part)
    assert shares["samples"] == 4
    assert shares["self_pct"] == {"vllm: async_llm.py": 75.0, "serve_app/replica/feed.py": 25.0}
    assert shares["inclusive_pct"]["ray.serve: replica.py"] == 100.0
