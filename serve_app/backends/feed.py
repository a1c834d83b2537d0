"""The gateway's end of the replicas' feeds (``serve_app/replica/feed.py``): one reader per
replica hands each fed stream its batches.

A fed stream's reader (``FedStream``) is the pool backend's stream after its first batch. Its
waits are timed by one timer re-armed once per idle period, not one per frame (a frame costs an
append and a wake-up), and when the relay falls behind (a client that reads slowly) the stream
is paused at its replica, as gRPC's flow control paused a handle stream: the gateway holds at
most ``BEHIND_ITEMS`` batches of a stream, and its replica's engine output merges meanwhile.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

from serve_app import errors, hop_delays

# Batches a fed stream may hold here unread before its replica is asked to pause it, and the
# number it resumes at. A batch is a frame or more (at most 64): ~16 KiB for a slow stream's
# single frames, less than a handle stream's window (``stream_window.py``).
BEHIND_ITEMS = 64
CAUGHT_UP_ITEMS = 16

_END = None


class FedStream:
    """One stream's batches from its feed, read by one consumer (``batches``)."""

    __slots__ = (
        "_failure",
        "_items",
        "_last",
        "_loop",
        "_on_pause",
        "_paused",
        "_timer",
        "_turns",
        "_waiter",
        "replica",
    )

    def __init__(self, on_pause: Callable[[bool, int], None]) -> None:
        self.replica: str | None = None  # set once the first batch named it
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._failure: BaseException | None = None
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()  # when the last batch came (or the stream started)
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._turns = 0  # pauses and resumes asked so far
        self._on_pause = on_pause

    def put(self, entry: object) -> None:
        """A batch (a list), the end (None) or an error (a refusal-shaped dict), in order."""
        self._items.append(entry)
        self._last = self._loop.time()
        self._wake()
        if not self._paused and len(self._items) > BEHIND_ITEMS:
            self._paused = True
            self._turns += 1
            self._on_pause(True, self._turns)

    def fail(self, exc: BaseException) -> None:
        """The stream cannot go on (its feed or its handle failed): after what has come."""
        if self._failure is None:
            self._failure = exc
            self._wake()

    def unread_usage(self) -> dict | None:
        """The usage of a batch that came and was never read (the client left just then)."""
        for entry in self._items:
            if type(entry) is list:
                for item in entry:
                    if type(item) is dict and "usage" in item:
                        return item["usage"]
        return None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def batches(self, idle_s: float, deadline: float) -> AsyncIterator[list]:
        """The batches until the stream's end; raises its error, or ``upstream_timeout`` when
        none came for ``idle_s`` or ``deadline`` (loop time) passed."""
        items, loop = self._items, self._loop
        while True:
            if items:
                if loop.time() >= deadline:  # a steady stream is bounded too
                    raise errors.upstream_timeout("The model did not finish in time.")
                entry = items.popleft()
                if entry is _END:
                    return
                if type(entry) is dict:
                    errors.raise_if_refused(entry)
                if self._paused and len(items) <= CAUGHT_UP_ITEMS:
                    self._paused = False
                    self._turns += 1
                    self._on_pause(False, self._turns)
                yield entry
                continue
            if self._failure is not None:
                raise self._failure
            await self._wait(idle_s, deadline)

    async def _wait(self, idle_s: float, deadline: float) -> None:
        loop = self._loop
        self._waiter = loop.create_future()
        if self._timer is None:
            self._arm(idle_s, deadline)
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _arm(self, idle_s: float, deadline: float) -> None:
        self._timer = self._loop.call_at(
            min(self._last + idle_s, deadline), self._check, idle_s, deadline
        )

    def _check(self, idle_s: float, deadline: float) -> None:
        """The timer: fail a stream that waited too long, else re-arm from its last batch."""
        self._timer = None
        if self._items or self._failure is not None:
            return  # the consumer has something to take; its next wait re-arms
        now = self._loop.time()
        if now >= deadline:
            self.fail(errors.upstream_timeout("The model did not finish in time."))
        elif now >= self._last + idle_s:
            self.fail(errors.upstream_timeout("The model did not keep answering in time."))
        else:
            self._arm(idle_s, deadline)


def demultiplex(batch: list, streams: dict[str, FedStream]) -> None:
    """One feed item: each ``(key, entry)`` to its stream (a stream already gone drops it)."""
    timed = hop_delays.DIR is not None
    for key, entry in batch:
        if timed:
            hop_delays.note(hop_delays.GATEWAY_IN, entry)
        stream = streams.get(key)
        if stream is not None:
            stream.put(entry)
