"""Feeds: a pool backend streaming from a real ``Replica`` in this process, each call made the
way a Serve handle makes it (the replica's generator run by a task of its own, cancelled as
Serve cancels it), so a stream's frames come back over the handle or over the gateway's feed
exactly as they do through Serve."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from serve_app.backends import feed as gateway_feed
from serve_app.backends.base import Timeouts
from serve_app.backends.feed import FedStream
from serve_app.backends.pool import PoolBackend
from serve_app.errors import ForgeError
from serve_app.replica import feed as replica_feed
from serve_app.replica.autoscaling import OPEN_FEEDS
from serve_app.replica.server import Replica
from tests.polling import eventually_async

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 40,
    "stream": True,
    "stream_options": {"include_usage": True},
}


class Call:
    """One handle call: the replica's generator pulled by a task, as a replica runs it."""

    def __init__(self, source) -> None:
        self._items: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._pull(source))

    async def _pull(self, source) -> None:
        try:
            async for item in source:
                await self._items.put(("item", item))
            await self._items.put(("end", None))
        except asyncio.CancelledError:
            await self._items.put(("error", asyncio.CancelledError()))
            raise
        except Exception as exc:
            await self._items.put(("error", exc))
        finally:
            await source.aclose()

    async def _fetch_future_result_async(self) -> None:
        """Serve: resolves once a replica took the call (here at once)."""

    def __aiter__(self):
        return self

    async def __anext__(self):
        kind, value = await self._items.get()
        if kind == "end":
            await self._items.put((kind, value))
            raise StopAsyncIteration
        if kind == "error":
            raise value
        return value

    def cancel(self) -> None:
        self._task.cancel()


class Method:
    def __init__(self, replica: Replica, name: str) -> None:
        self.replica, self.name = replica, name

    def remote(self, *args, **kwargs):
        result = getattr(self.replica, self.name)(*args, **kwargs)
        if hasattr(result, "__aiter__"):
            self.replica.calls.append(self.name)
            return Call(result)

        async def unary():
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.ensure_future(unary())


class Handle:
    """A Serve handle to one replica."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        replica.calls = []

    def options(self, **_):
        return self

    def __getattr__(self, name: str) -> Method:
        return Method(self.replica, name)


def pool(**engine) -> tuple[PoolBackend, Replica]:
    replica = Replica({"name": "p", "model": "m", "engine": engine})
    return gateway(replica), replica


def gateway(replica: Replica) -> PoolBackend:
    """A gateway replica's pool backend, streaming from ``replica``."""
    backend = PoolBackend("p", Handle(replica), Timeouts(5.0, 5.0, 5.0, 60.0))
    backend.bridge.replica_ids = frozenset({replica.replica_id})
    return backend


def frames(batches: list[list]) -> list[bytes]:
    return [x for b in batches for x in b if type(x) is bytes]


async def drain(backend: PoolBackend, body: dict = BODY, request_id: str = "r") -> list[list]:
    return [b async for b in backend.stream(body, "chat", request_id)]


async def open_feed(backend: PoolBackend, replica: Replica) -> None:
    """The first stream from a replica goes over its handle and opens the feed for the next."""
    first = await drain(backend, request_id="opener")
    assert "fed" not in first[0][0]
    await eventually_async(
        lambda: bool(replica._feeds), timeout_s=5, what="the gateway's feed to open"
    )


async def test_after_the_first_stream_the_frames_come_over_the_feed_all_of_them_in_order():
    backend, replica = pool()
    by_handle = await drain(backend, request_id="same")
    await eventually_async(
        lambda: bool(replica._feeds), timeout_s=5, what="the gateway's feed to open"
    )

    fed = await drain(backend, request_id="same")  # the same request again: the same frames

    assert fed[0][0] == {"replica": replica.replica_id, "fed": True}
    assert "fed" not in by_handle[0][0]
    # The same frames as over the handle, the usage last (the simulator is deterministic).
    assert frames(fed) == frames(by_handle)
    assert fed[-1][-1]["usage"]["completion_tokens"] == 40
    assert replica.calls == ["stream", "feed", "stream"]  # one feed, kept for the next


async def test_many_streams_share_one_feed_and_each_gets_its_own_frames():
    backend, replica = pool()
    await open_feed(backend, replica)
    bodies = [{**BODY, "max_tokens": n, "ignore_eos": True} for n in (5, 17, 33, 64)]

    results = await asyncio.gather(
        *(drain(backend, body, f"r{i}") for i, body in enumerate(bodies))
    )

    for body, batches in zip(bodies, results, strict=True):
        assert batches[0][0].get("fed") is True
        assert batches[-1][-1]["usage"]["completion_tokens"] == body["max_tokens"]
    assert replica.calls.count("feed") == 1


async def test_a_reader_that_falls_behind_pauses_its_stream_at_the_replica(monkeypatch):
    """The gateway holds a few batches of a stream nobody reads, not the generation: the rest
    waits at the replica, as it waits there for a handle stream's reader."""
    monkeypatch.setattr(gateway_feed, "BEHIND_ITEMS", 4)
    monkeypatch.setattr(gateway_feed, "CAUGHT_UP_ITEMS", 1)
    backend, replica = pool(decode_base_s=0.001)
    await open_feed(backend, replica)
    body = {**BODY, "max_tokens": 600, "ignore_eos": True}
    stream = backend.stream(body, "chat", "slow")
    await anext(stream)
    await anext(stream)  # fed from here; then the reader stops reading

    def paused() -> bool:
        (feed,) = replica._feeds.values()
        return any(not gate.is_set() for gate in feed.gates.values())

    await eventually_async(paused, timeout_s=10, what="the replica to pause the stream")
    await asyncio.sleep(0.3)  # unpaused, the engine would send ~300 more frames meanwhile
    (held,) = backend._fed.values()
    assert len(held._items) <= 8  # the 4 it may hold, and what was on its way as it asked

    rest = [b async for b in stream]  # the reader catches up: the stream resumes and ends
    assert rest[-1][-1]["usage"]["completion_tokens"] == 600


async def test_a_client_leaving_a_fed_stream_aborts_it_and_its_usage_is_what_was_generated():
    backend, replica = pool(decode_base_s=0.01)
    await open_feed(backend, replica)
    body = {**BODY, "max_tokens": 500, "ignore_eos": True}
    stream = backend.stream(body, "chat", "leaver")
    first = await anext(stream)
    assert first[0].get("fed") is True
    await anext(stream)
    await stream.aclose()

    await eventually_async(
        lambda: replica.stats()["num_requests_running"] == 0,
        timeout_s=5,
        what="the left stream's generation to be aborted",
        explain=replica.stats,
    )
    usage = await backend.abandoned_usage("leaver", replica.replica_id)
    assert 0 < usage["completion_tokens"] < 500


async def test_a_generation_failing_mid_stream_ends_a_fed_stream_with_its_error_after_its_frames():
    backend, replica = pool()
    await open_feed(backend, replica)
    replica.set_fault({"mode": "die_mid_stream", "after_frames": 6, "exit_process": False})
    got: list[list] = []

    with pytest.raises(ForgeError) as info:
        async for batch in backend.stream(BODY, "chat", "dies"):
            got.append(batch)

    assert got[0][0].get("fed") is True
    assert info.value.status == 502 and "stream died" in info.value.message
    assert len(frames(got)) >= 5  # what came before the error came, in order


async def test_an_idle_feed_ends_and_the_next_stream_opens_it_again(monkeypatch):
    monkeypatch.setattr(replica_feed, "FEED_IDLE_S", 0.2)
    backend, replica = pool()
    await open_feed(backend, replica)
    await eventually_async(
        lambda: not replica._feeds and not backend._feeds,
        timeout_s=5,
        what="the idle feed to end at both ends",
    )

    again = await drain(backend, request_id="after-idle")

    assert "fed" not in again[0][0]  # no feed at the replica: the handle, in full
    assert again[-1][-1]["usage"]["completion_tokens"] == 40
    await eventually_async(lambda: bool(replica._feeds), timeout_s=5, what="a new feed")


async def test_a_fed_stream_silent_past_its_idle_timeout_is_a_504():
    fed = FedStream(lambda paused, turn: None)
    fed.put([b"data: {}\n\n"])
    loop = asyncio.get_running_loop()
    batches = fed.batches(idle_s=0.05, deadline=loop.time() + 10)

    assert await anext(batches) == [b"data: {}\n\n"]
    with pytest.raises(ForgeError) as info:
        await anext(batches)
    assert info.value.status == 504 and "keep answering" in info.value.message
    fed.close()


async def test_a_fed_stream_past_its_deadline_is_a_504_however_steady():
    fed = FedStream(lambda paused, turn: None)
    loop = asyncio.get_running_loop()
    batches = fed.batches(idle_s=10, deadline=loop.time() + 0.2)

    async def steady() -> None:
        while True:
            fed.put([b"data: {}\n\n"])
            await asyncio.sleep(0.02)

    feeder = asyncio.ensure_future(steady())
    try:
        with pytest.raises(ForgeError) as info:
            async for _ in batches:
                await asyncio.sleep(0.05)  # slower than the feeder: never idle
    finally:
        feeder.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeder
        fed.close()
    assert info.value.status == 504 and "finish in time" in info.value.message


async def test_a_resume_that_overtakes_its_pause_leaves_the_stream_flowing():
    """Two pinned calls may arrive out of order; the later turn wins either way."""
    feed = replica_feed.Feed("g")
    gate = feed.join("k")

    assert feed.pause("k", False, 2)  # the resume, first
    assert feed.pause("k", True, 1)  # then the pause it overtook: ignored
    assert gate.is_set()
    assert feed.pause("k", True, 3)
    assert not gate.is_set()
    assert not feed.pause("gone", True, 1)  # a stream not here


async def test_a_feed_its_gateway_does_not_take_holds_its_streams_back_not_their_frames(
    monkeypatch,
):
    monkeypatch.setattr(replica_feed, "ITEM_ENTRIES", 3)
    monkeypatch.setattr(replica_feed, "BACKLOG_ENTRIES", 6)
    feed = replica_feed.Feed("g")
    feed.join("k")
    for n in range(6):
        await feed.room()
        feed.send("k", [n])
    waiting = asyncio.ensure_future(feed.room())  # the seventh waits: the backlog is full
    await asyncio.sleep(0)
    assert not waiting.done()

    items = feed.items()
    first = await anext(items)  # the gateway takes one item, at most ITEM_ENTRIES long

    assert first == [("k", [0]), ("k", [1]), ("k", [2])]
    await asyncio.wait_for(waiting, 1)  # room again
    assert await anext(items) == [("k", [3]), ("k", [4]), ("k", [5])]
    await items.aclose()


async def test_a_feed_item_stays_within_its_byte_bound_however_many_batches_wait(monkeypatch):
    monkeypatch.setattr(replica_feed, "ITEM_BYTES", 1_000)
    feed = replica_feed.Feed("g")
    feed.join("k")
    for _ in range(5):
        feed.send("k", [b"x" * 400])  # 2,000 bytes waiting: more than one item's worth

    items = feed.items()
    sizes = [sum(len(f) for _, e in await anext(items) for f in e) for _ in range(3)]

    assert sizes == [800, 800, 400]
    await items.aclose()


async def test_a_replica_reports_one_open_feed_per_gateway_streaming_from_it_to_autoscaling(
    monkeypatch,
):
    # What the pool's autoscaling policy takes off Serve's count (replica/autoscaling.py).
    monkeypatch.setattr(replica_feed, "FEED_IDLE_S", 0.2)
    first, replica = pool()
    second = gateway(replica)
    assert await replica.record_autoscaling_stats() == {OPEN_FEEDS: 0}

    await open_feed(first, replica)
    await drain(second, request_id="second-gateway")
    await eventually_async(lambda: len(replica._feeds) == 2, timeout_s=5, what="both feeds")

    assert await replica.record_autoscaling_stats() == {OPEN_FEEDS: 2}
    await eventually_async(lambda: not replica._feeds, timeout_s=5, what="both feeds to end")
    assert await replica.record_autoscaling_stats() == {OPEN_FEEDS: 0}
