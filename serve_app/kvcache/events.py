"""KV-cache events: each replica pushes what its prefix cache stores and evicts, as it happens.

A KV-aware router is only as good as its picture of where prompts are cached. Polled reports
(Serve's routing stats) are up to a period old and carry the whole block set each time; here
the replica publishes *changes* the moment its engine makes them, plus the prefill work it has
queued (``EngineLoad``), and the routers of every gateway replica apply them to their index
(``serve_app/routing/kv_index.py``) within milliseconds.

Transport: ZeroMQ PUB/SUB, as vLLM's own KV event publisher uses; chosen by measurement
(``loadtest/kv_transport.py``, ``docs/routing.md``). One PUB socket per replica, bound on the
node's address at a free port; routers learn it from the replica's routing stats.

Reliability: every message carries the publisher's ``epoch`` (random per process) and a ``seq``
(+1 per message). A router that sees a new epoch or a gap asks the replica's snapshot socket
for the full block set and the seq it is current to, then replays what it buffered after
that seq. Applying a message twice is harmless (its operations are set adds and removes in
order), which is what makes snapshot-then-replay exact. A heartbeat each ``heartbeat_s``
bounds how long a lost last message can go unnoticed.

Wire format (msgpack): frames ``[replica_id, payload]``; payload ``{"epoch", "seq", "ts",
"ops": [["s", [hash, ...]] | ["r", [hash, ...]] | ["c"]], "accepted": [request_id, ...],
"load": {"backlog", "running", "waiting", "slots"}}``. Hashes are Forge's block-hash chain
(``serve_app/kvcache/block_hashes.py``); nothing of a prompt's text leaves the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass

import msgpack
import zmq
import zmq.asyncio

logger = logging.getLogger("ray.serve")

STORED, REMOVED, CLEARED = "s", "r", "c"
SNAPSHOT_REQUEST = b"snapshot"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a replica has queued, pushed with its events: the router's load bound reads it.

    ``backlog`` is prefill work in tokens: the uncached prompt tokens of its waiting requests
    plus what is left of the prefills under way. ``slots`` is its ``max_num_seqs``.
    """

    backlog: int = 0
    running: int = 0
    waiting: int = 0
    slots: int = 1


def encode(payload: dict) -> bytes:
    return msgpack.packb(payload, use_bin_type=True)


def decode(raw: bytes) -> dict:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


class KvEventPublisher:
    """The replica's side: collects its engine's changes and publishes them once per step.

    The engine calls ``stored``/``removed``/``cleared``/``accepted`` as things happen and
    ``flush`` at the end of each scheduling step (one message per step, not per block). All of
    it runs on the replica's event loop, so a snapshot is always consistent with ``seq``.
    ``snapshot`` returns the engine's current cached block hashes.
    """

    def __init__(
        self,
        replica_id: str,
        snapshot: Callable[[], Collection[int]],
        host: str = "127.0.0.1",
        heartbeat_s: float = 1.0,
    ) -> None:
        self.replica_id = replica_id
        self._topic = replica_id.encode()
        self._snapshot = snapshot
        self._heartbeat_s = heartbeat_s
        self.epoch = random.getrandbits(63)
        self.seq = 0
        self._ops: list[list] = []
        self._accepted: list[str] = []
        self._load = EngineLoad()
        self._last_sent = 0.0
        # PUB is a plain socket (a send never waits, so it needs no loop); the snapshot socket
        # is served on the replica's loop.
        self._pub_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context()
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)  # a slow router loses messages, then resyncs
        self._rep = self._ctx.socket(zmq.ROUTER)
        self._rep.setsockopt(zmq.LINGER, 0)
        pub_port = self._pub.bind_to_random_port(f"tcp://{host}")
        rep_port = self._rep.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{pub_port}"
        self.snapshot_endpoint = f"tcp://{host}:{rep_port}"
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Serve snapshots and heartbeats on the running loop."""
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self._serve_snapshots()),
                loop.create_task(self._beat()),
            ]

    def describe(self) -> dict:
        """For the replica's routing stats: where routers subscribe."""
        return {"endpoint": self.endpoint, "snapshot": self.snapshot_endpoint, "epoch": self.epoch}

    # The engine's calls.

    def stored(self, hashes: Iterable[int]) -> None:
        self._append(STORED, hashes)

    def removed(self, hashes: Iterable[int]) -> None:
        self._append(REMOVED, hashes)

    def cleared(self) -> None:
        self._ops.append([CLEARED])

    def accepted(self, request_id: str) -> None:
        """The engine took this request in: routers stop counting it as theirs in flight."""
        self._accepted.append(request_id)

    def flush(self, load: EngineLoad) -> None:
        """Publish what changed since the last flush (nothing changed, nothing sent)."""
        if not self._ops and not self._accepted and load == self._load:
            return
        self._load = load
        self._send()

    def _append(self, kind: str, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        if not hashes:
            return
        if self._ops and self._ops[-1][0] == kind:
            self._ops[-1][1].extend(hashes)
        else:
            self._ops.append([kind, hashes])

    def _send(self) -> None:
        self.seq += 1
        payload = {
            "epoch": self.epoch,
            "seq": self.seq,
            "ts": time.time(),
            "ops": self._ops,
            "accepted": self._accepted,
            "load": asdict(self._load),
        }
        self._ops, self._accepted = [], []
        self._last_sent = time.monotonic()
        with contextlib.suppress(zmq.Again):  # PUB never blocks; a full queue drops (resync)
            self._pub.send_multipart([self._topic, encode(payload)], flags=zmq.NOBLOCK)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            if time.monotonic() - self._last_sent >= self._heartbeat_s:
                self._send()

    async def _serve_snapshots(self) -> None:
        while True:
            frames = await self._rep.recv_multipart()
            if len(frames) < 2 or frames[-1] != SNAPSHOT_REQUEST:
                continue  # not a snapshot request: ignored, never an error to a stranger
            # Events not yet flushed are already in the engine's set: the router replays them
            # from the next message, harmlessly (see the module docstring).
            reply = {
                "epoch": self.epoch,
                "seq": self.seq,
                "blocks": list(self._snapshot()),
                "load": asdict(self._load),
            }
            await self._rep.send_multipart([*frames[:-1], encode(reply)])  # REQ or DEALER

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._pub.close()
        self._rep.close()
        self._pub_ctx.term()
        self._ctx.term()
