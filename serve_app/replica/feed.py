"""A feed: one handle stream from a replica to one gateway replica, carrying the frames of all
the requests that gateway streams from here, batched.

Why: a Serve handle stream costs the gateway per item, not per byte (a gRPC message, its read,
unpickling, Serve's wrapper, a task wake-up), and a slow generation (an agent's long answer at
a few tokens a second) has one frame ready at a time, so each token was one item: ~200 µs of
the gateway's CPU per token, ~1,000 such streams per core (docs/benchmarks.md, "Concurrency").
A request still goes through the handle (Serve's routing, its count of ongoing requests and so
autoscaling, cancellation, ``abandoned_usage``), and its first batch comes back over it, so the
time to first token is the handle's as before; the rest of its frames come back over the feed,
in one item with every other stream's frames that are ready at that moment.

A feed ends when its gateway closes it (or dies), and by itself after ``FEED_IDLE_S`` with no
stream on it, so it never keeps a replica busy that Serve would scale down or replace. A stream
whose feed ends under it is ended (its generation aborted): nobody reads it any more.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from serve_app import hop_delays

# A feed no stream used for this long ends; the gateway opens another when it needs one. Short:
# Serve counts a feed as an ongoing request, so a replica being replaced or scaled down waits
# this long past its last stream (the pool's autoscaling takes feeds off its count:
# ``replica/autoscaling.py``); reopening costs one handle call, and a gateway with a stream there
# at least once a second keeps its feed.
FEED_IDLE_S = 1.0
# Under load, at most one item a millisecond: each carries every frame that became ready
# meanwhile. A feed idle for longer sends its next frame at once (a lone stream's latency is
# unchanged); a busy one adds at most this to a frame's way out.
FLUSH_EVERY_S = 0.001
# At most this many streams' batches in one item, and about this many bytes of frames (a
# batch is at most ``STREAM_QUEUE_ITEMS`` frames): an item stays well below the 4 MiB a
# gateway's channel takes in one message (``RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH``), and
# a backlog goes as several.
ITEM_ENTRIES = 512
ITEM_BYTES = 1 << 20
# Batches waiting to be sent, past which the feed's streams wait to add more (their engines'
# output merges meanwhile, as for a reader that is behind): a feed its gateway is slow to take
# (gRPC's flow control, a gateway starved of its core) holds this much here, not a generation.
BACKLOG_ENTRIES = 4 * ITEM_ENTRIES


class FeedClosed(Exception):
    """The gateway's end of the feed is gone."""


class Feed:
    """What this replica sends one gateway: ``(key, entry)`` pairs in order, where an entry is
    a stream's batch (a list), ``None`` for its end, or a refusal-shaped dict for its error
    (``errors.refusal_item``: no exception object crosses the feed)."""

    def __init__(self, feed_id: str) -> None:
        self.id = feed_id
        self.closed = False
        self._pending: list[tuple[str, object]] = []
        self._sizes: list[int] = []  # each pending entry's frames, in bytes
        self._wakeup = asyncio.Event()
        self._room = asyncio.Event()  # set while the backlog is below ``BACKLOG_ENTRIES``
        self._room.set()
        # Streams on this feed: the gate each waits at (set: flowing; clear: its reader paused).
        self.gates: dict[str, asyncio.Event] = {}
        self._turns: dict[str, int] = {}  # the last pause or resume taken, per stream

    def join(self, key: str) -> asyncio.Event:
        gate = asyncio.Event()
        gate.set()
        self.gates[key] = gate
        return gate

    def leave(self, key: str) -> None:
        self.gates.pop(key, None)
        self._turns.pop(key, None)

    def send(self, key: str, entry: object) -> None:
        if self.closed:
            raise FeedClosed(self.id)
        self._pending.append((key, entry))
        if hop_delays.DIR is not None:
            hop_delays.note(hop_delays.INTO_FEED, entry)
        self._sizes.append(
            sum(len(x) for x in entry if type(x) is bytes) if type(entry) is list else 0
        )
        self._wakeup.set()
        if len(self._pending) >= BACKLOG_ENTRIES:
            self._room.clear()

    async def room(self) -> None:
        """Returns once the backlog has room (at once, mostly)."""
        if not self._room.is_set():
            await self._room.wait()

    def pause(self, key: str, paused: bool, turn: int) -> bool:
        """The gateway's reader of ``key`` is behind (or caught up): its stream waits (or
        goes on). ``turn`` counts the reader's changes: one that arrives after a later one
        (two calls may overtake each other) changes nothing. False for a stream not here."""
        gate = self.gates.get(key)
        if gate is None:
            return False
        if turn <= self._turns.get(key, 0):
            return True
        self._turns[key] = turn
        if paused:
            gate.clear()
        else:
            gate.set()
        return True

    def close(self) -> None:
        self.closed = True
        self._room.set()
        for gate in self.gates.values():
            gate.set()  # a paused stream wakes to find its feed gone

    async def items(self) -> AsyncIterator[list[tuple[str, object]]]:
        """What is pending, as one item at a time, until the feed has been idle with no
        stream on it for ``FEED_IDLE_S``."""
        loop = asyncio.get_running_loop()
        flushed = 0.0
        while True:
            if not self._pending:
                self._wakeup.clear()
                try:
                    async with asyncio.timeout(FEED_IDLE_S):
                        await self._wakeup.wait()
                except TimeoutError:
                    if not self.gates:
                        return  # no await from here to the caller's unregistering: atomic
                    continue
            wait = flushed + FLUSH_EVERY_S - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            count, size = 0, 0
            for entry_size in self._sizes:
                if count and (count == ITEM_ENTRIES or size + entry_size > ITEM_BYTES):
                    break
                count, size = count + 1, size + entry_size
            batch = self._pending[:count]
            del self._pending[:count], self._sizes[:count]
            if len(self._pending) < BACKLOG_ENTRIES:
                self._room.set()
            flushed = loop.time()
            if hop_delays.DIR is not None:
                for _, entry in batch:
                    hop_delays.note(hop_delays.FEED_OUT, entry)
            yield batch
