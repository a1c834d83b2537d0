"""What a generation whose caller left cost, asked of the replica right after
(``abandoned_usage``): exactly what the engine generated, wherever the caller left (mid-stream,
or before a non-streamed answer came), so the tenant is charged the engine's count and never the
gateway's estimate, nor nothing."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from serve_app.replica.server import Replica
from tests.polling import eventually_async

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 12,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def replica() -> Replica:
    return Replica({"name": "p", "model": "m", "engine": {"kind": "simulated"}})


async def test_a_caller_that_left_after_the_engine_finished_is_charged_the_engines_count():
    """The generation ended (so nothing was aborted) but the caller left before the batch with
    its usage reached it: the replica still knows what it cost."""
    r = replica()
    stream = r.stream(BODY, "chat", "req-done")
    await anext(stream)  # the replica's first batch
    # The engine runs ahead of a slow caller and finishes the whole generation.
    await eventually_async(
        lambda: r.engine.llm.generation_tokens == 12,
        timeout_s=5,
        what="the engine to finish all 12 tokens",
        explain=r.stats,
    )
    await stream.aclose()  # the caller left before the rest, usage included, reached it
    usage = await r.abandoned_usage(0.5, request_id="req-done", replica_id=r.replica_id)
    assert usage is not None and usage["completion_tokens"] == 12
    assert usage["prompt_tokens"] > 0


# Asked ``if_received``: of each replica a request cancelled before Serve heard which took it
# was offered (``dispatch._cost_on_any``); the one that ran it answers as when asked by name.
@pytest.mark.parametrize("asked", [{"replica_id": "local"}, {"if_received": True}])
async def test_a_caller_that_left_mid_generation_is_charged_what_was_generated(asked):
    r = replica()
    stream = r.stream({**BODY, "max_tokens": 200}, "chat", "req-mid")
    await anext(stream)
    await anext(stream)
    await stream.aclose()
    usage = await r.abandoned_usage(1.0, request_id="req-mid", **asked)
    assert usage is not None and 0 < usage["completion_tokens"] < 200


async def test_a_stream_the_caller_read_to_its_end_leaves_nothing_to_collect():
    r = replica()
    batches = [b async for b in r.stream(BODY, "chat", "req-read")]
    assert batches[-1][-1]["usage"]["completion_tokens"] == 12
    assert await r.abandoned_usage(0.05, request_id="req-read", replica_id=r.replica_id) is None


async def test_asked_before_its_stream_is_closed_the_replica_ends_the_generation_itself():
    """The gateway asks as soon as it has closed its end, and Serve's cancellation of the
    replica's stream may come later (or, for a stream parked at a ``yield``, not until much
    later): the answer must not wait for it, nor be lost when it never comes in time."""
    r = replica()
    stream = r.stream({**BODY, "max_tokens": 2000, "ignore_eos": True}, "chat", "req-parked")
    await anext(stream)
    await anext(stream)  # parked: nobody reads on, nobody closes it
    usage = await r.abandoned_usage(1.0, request_id="req-parked", replica_id=r.replica_id)
    assert usage is not None and 0 < usage["completion_tokens"] < 2000
    assert r.engine.llm.num_requests_running == 0  # aborted, not left generating
    await stream.aclose()  # Serve's cancellation, late: nothing is counted twice
    assert await r.abandoned_usage(0.05, request_id="req-parked", replica_id=r.replica_id) is None


async def test_a_finished_generation_parked_unread_is_charged_once():
    r = replica()
    stream = r.stream(BODY, "chat", "req-finished")
    await anext(stream)
    await eventually_async(
        lambda: r.engine.llm.generation_tokens == 12,
        timeout_s=5,
        what="the engine to finish all 12 tokens",
        explain=r.stats,
    )
    usage = await r.abandoned_usage(0.5, request_id="req-finished", replica_id=r.replica_id)
    assert usage is not None and usage["completion_tokens"] == 12
    await stream.aclose()
    assert await r.abandoned_usage(0.05, request_id="req-finished", replica_id=r.replica_id) is None


UNSTREAMED = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 2000,
    "ignore_eos": True,
}


async def _generating(r: Replica, request_id: str):
    """A non-streamed call under way, its engine some tokens into the generation."""
    call = asyncio.ensure_future(r.complete(UNSTREAMED, "chat", request_id))
    await eventually_async(
        lambda: r.engine.llm.generation_tokens >= 3,
        timeout_s=5,
        what="the engine to generate a few tokens",
        explain=r.stats,
    )
    return call


async def test_a_non_streamed_call_cancelled_mid_generation_is_charged_what_was_generated():
    """Serve cancels the replica's call when the gateway's client left; the prompt and the
    tokens generated so far are what the engine spent, and the gateway asks for them."""
    r = replica()
    call = await _generating(r, "req-unstreamed")
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await call
    usage = await r.abandoned_usage(1.0, request_id="req-unstreamed", replica_id=r.replica_id)
    assert usage is not None and 0 < usage["completion_tokens"] < 2000
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] == r.engine.llm.generation_tokens
    assert r.engine.llm.num_requests_running == 0


async def test_asked_before_serve_cancels_it_a_non_streamed_call_is_ended_by_the_replica():
    """The gateway's question may come before Serve's cancellation of the call (or instead of
    it): the replica ends the generation itself, so the answer is the cost, not a timeout."""
    r = replica()
    call = await _generating(r, "req-unstreamed-parked")
    usage = await r.abandoned_usage(
        1.0, request_id="req-unstreamed-parked", replica_id=r.replica_id
    )
    assert usage is not None and 0 < usage["completion_tokens"] < 2000
    assert r.engine.llm.num_requests_running == 0  # aborted, not left generating
    with contextlib.suppress(asyncio.CancelledError):
        await call
    assert call.cancelled() or call.exception() is not None
    assert (
        await r.abandoned_usage(0.05, request_id="req-unstreamed-parked", replica_id=r.replica_id)
        is None
    )


async def test_asked_if_received_a_replica_the_request_never_reached_answers_at_once():
    """A request cancelled before Serve heard which replica took it is asked about on each it
    was offered (``dispatch._cost_on_any``): one it never reached says so without the wait
    the one that ran it may need for its abort to land."""
    r = replica()
    answer = r.abandoned_usage(30.0, request_id="never-sent", if_received=True)
    assert await asyncio.wait_for(answer, 5) is None
