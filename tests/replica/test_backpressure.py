"""A caller that reads slowly costs the replica a bounded queue, never a whole generation.

The replica's producer waits while its stream's queue (``STREAM_QUEUE_ITEMS``) is full; the
engine keeps generating, as vLLM does, and holds what the caller has not taken as one merged
output, which reaches the caller as one longer frame. Memory is measured with ``tracemalloc``
(allocations, not time), so the bound holds on any machine.
"""

from __future__ import annotations

import gc
import tracemalloc

import orjson

from serve_app.replica.server import STREAM_QUEUE_ITEMS, Replica
from tests.polling import eventually_async

TOKENS = 4000
BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "tell me everything"}],
    "max_tokens": TOKENS,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def replica() -> Replica:
    return Replica({"name": "p", "model": "m", "engine": {"kind": "simulated"}})


def text_of(batches: list[list]) -> str:
    pieces = []
    for frame in (x for b in batches for x in b if type(x) is bytes):
        chunk = orjson.loads(frame[6:])
        pieces += [c["delta"].get("content") or "" for c in chunk["choices"]]
    return "".join(pieces)


async def test_a_parked_caller_costs_the_replica_a_bounded_queue_not_the_generation():
    fast = [b async for b in replica().stream(BODY, "chat", "req-fast")]
    r = replica()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        stream = r.stream(BODY, "chat", "req-slow")
        batches = [await anext(stream)]
        # The caller reads nothing more; the engine is not held back: it generates all of it.
        await eventually_async(
            lambda: r.engine.llm.generation_tokens == TOKENS,
            timeout_s=20,
            what=f"the engine to generate all {TOKENS} tokens",
            explain=r.stats,
        )
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # 4000 frames of ~230 bytes each would be ~1 MiB; the queue's 64 frames and 4000 merged
    # tokens (an id and a word reference each) are a few tens of KiB.
    assert held < 200_000, f"a parked stream holds {held} bytes in the replica"
    (generation,) = r._generations["req-slow"]
    assert generation.queue.qsize() <= STREAM_QUEUE_ITEMS

    batches += [b async for b in stream]
    assert all(len(b) <= STREAM_QUEUE_ITEMS + 1 for b in batches)
    frames = sum(1 for b in batches for x in b if type(x) is bytes)
    assert frames < TOKENS / 2, "what the caller did not take came merged, in fewer frames"
    assert text_of(batches) == text_of(fast), "and says exactly what a fast caller read"
    assert batches[-1][-1]["usage"]["completion_tokens"] == TOKENS
    assert fast[-1][-1]["usage"] == batches[-1][-1]["usage"]


async def test_a_usage_still_waiting_for_room_is_charged_when_the_caller_leaves():
    """The engine finished while the queue was full: its final ``Usage`` is in the producer's
    hands, queued nowhere, and still what the caller that leaves now is charged."""
    r = replica()
    stream = r.stream(BODY, "chat", "req-full")
    await anext(stream)
    await eventually_async(
        lambda: r.engine.llm.generation_tokens == TOKENS and r.engine.llm.num_requests_running == 0,
        timeout_s=20,
        what="the engine to finish while nobody reads",
        explain=r.stats,
    )
    (generation,) = r._generations["req-full"]
    await eventually_async(
        lambda: generation.queue.full(), timeout_s=5, what="the stream's queue to fill"
    )
    await stream.aclose()
    usage = await r.abandoned_usage(0.5, request_id="req-full", replica_id=r.replica_id)
    assert usage is not None and usage["completion_tokens"] == TOKENS
    assert await r.abandoned_usage(0.05, request_id="req-full", replica_id=r.replica_id) is None


async def test_a_caller_that_leaves_a_full_queue_aborts_the_generation_at_once():
    """Cancelled while it waits for room, the producer is outside the engine's stream: it must
    still close it, so the engine aborts now and the slot is free."""
    r = replica()
    slow = {**BODY, "max_tokens": 8000}
    stream = r.stream(slow, "chat", "req-abort")
    await anext(stream)
    (generation,) = r._generations["req-abort"]
    await eventually_async(
        lambda: generation.queue.full(), timeout_s=5, what="the stream's queue to fill"
    )
    await stream.aclose()
    usage = await r.abandoned_usage(1.0, request_id="req-abort", replica_id=r.replica_id)
    assert usage is not None and 0 < usage["completion_tokens"] <= 8000
    assert r.engine.llm.num_requests_running == 0
