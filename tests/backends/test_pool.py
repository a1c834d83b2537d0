"""PoolBackend's four timeouts with a fake Serve handle: connect, first token, idle, total."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.backends.base import Timeouts
from serve_app.backends.pool import PoolBackend
from serve_app.errors import ForgeError


class FakeStream:
    """Stands in for a DeploymentResponseGenerator: yields after the given delays.

    The delays are the replica's latency, which the timeouts under test are measured against
    (in loop time): each is at least 4x away from the deadline it must meet or miss, and one
    that must miss it is free to oversleep.
    """

    def __init__(self, delays: list[float], assign_s: float = 0.0) -> None:
        self.delays = list(delays)
        self.assign_s = assign_s
        self.cancelled = False

    async def _fetch_future_result_async(self):  # Serve: resolves once a replica took it
        await asyncio.sleep(self.assign_s)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.delays:
            raise StopAsyncIteration
        await asyncio.sleep(self.delays.pop(0))
        return [b"data: {}\n\n"]

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, stream: FakeStream) -> None:
        self._fake = stream
        self.stream = self

    def options(self, **_):
        return self

    def remote(self, *args):
        return self._fake


def backend(stream: FakeStream, *, connect=0.2, first=0.2, idle=0.2, total=5.0) -> PoolBackend:
    return PoolBackend("p", FakeHandle(stream), Timeouts(connect, first, idle, total))


async def drain(pool: PoolBackend, budget_s: float | None = None) -> int:
    return len([b async for b in pool.stream({}, "chat", "r", budget_s)])


async def test_a_healthy_stream_passes_every_deadline():
    assert await drain(backend(FakeStream([0.02, 0.02, 0.02]))) == 3


@pytest.mark.parametrize(
    ("delays", "message"),
    [([0.5], "start answering"), ([0.01, 0.01, 0.5], "keep answering")],
)
async def test_a_silent_replica_is_a_504_and_its_generation_is_cancelled(delays, message):
    stream = FakeStream(delays)
    with pytest.raises(ForgeError) as info:
        await drain(backend(stream))
    assert info.value.status == 504 and message in info.value.message
    assert stream.cancelled


async def test_the_total_deadline_bounds_a_slow_but_steady_stream():
    stream = FakeStream([0.1] * 20)  # never idle for 1 s, but 2 s in all
    with pytest.raises(ForgeError) as info:
        await drain(backend(stream, first=1.0, idle=1.0, total=0.5))
    assert info.value.status == 504 and "did not finish" in info.value.message
    assert stream.cancelled


async def test_no_replica_taking_the_request_is_a_connect_timeout():
    stream = FakeStream([0.01], assign_s=1.0)  # every replica busy, or none up
    with pytest.raises(ForgeError) as info:
        await drain(backend(stream, connect=0.1))
    assert info.value.status == 504 and "took the request" in info.value.message
    assert stream.cancelled


async def test_a_client_deadline_shorter_than_the_pool_total_wins():
    stream = FakeStream([0.1] * 20)
    with pytest.raises(ForgeError) as info:
        await drain(backend(stream, first=1.0, idle=1.0, total=60), budget_s=0.5)
    assert info.value.status == 504 and "did not finish" in info.value.message
    assert stream.cancelled


class ContextRecordingHandle(FakeHandle):
    """Records, for each call, the Serve request context it was made in: Serve makes a call
    the child of that request, and cancels it with the request (``_on_request_cancelled``)."""

    def __init__(self) -> None:
        super().__init__(FakeStream([0.0]))
        self.abandoned_usage = self
        self.made_in: list[str | None] = []

    def remote(self, *args, **kwargs):
        from ray.serve import context

        made_in = context._serve_request_context.get()
        self.made_in.append(made_in and made_in._internal_request_id)
        if "replica_id" in kwargs:  # the follow-up call: answered at once
            done = asyncio.get_running_loop().create_future()
            done.set_result({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10})
            return done
        return self._fake


async def test_asking_what_an_abandoned_stream_cost_is_not_a_child_of_the_cancelled_request():
    """The gateway asks the replica what a stream cost right as Serve cancels the request whose
    client left; made as that request's child, Serve cancelled the question too and the tenant
    was charged an estimate (the books drill: 10 of 47 abandoned streams). The stream itself is
    the request's child (cancelled with it: the replica aborts); the question is nobody's."""
    from ray.serve import context

    handle = ContextRecordingHandle()
    pool = PoolBackend("p", handle, Timeouts(1, 1, 1, 5))
    pool.bridge.replica_ids = frozenset({"rep-1"})
    context._serve_request_context.set(context._RequestContext(_internal_request_id="req-9"))
    await drain(pool)
    usage = await pool.abandoned_usage("r", "rep-1")
    assert usage == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert handle.made_in == ["req-9", None]
    assert context._serve_request_context.get()._internal_request_id == "req-9"  # left as it was
