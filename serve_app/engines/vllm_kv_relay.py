"""vLLM's own KV-cache events, under vLLM's own block hashes, to the replica's publisher.

On a KV-aware pool the routers need to know which blocks each replica's vLLM holds, under names
they can compute themselves. They compute vLLM's (``serve_app/kvcache/vllm_block_hashes.py``:
its seed, hash function, LoRA and cache-salt keys), so the relay passes vLLM's names through as
the events give them (the digest's low 64 bits), and an adapter's blocks are routable like any
other. Its own module because what it forwards is the part worth testing, and it runs without
vLLM; only the socket's decoder and vLLM's ``KVEventsConfig`` import vLLM, lazily.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterable

import zmq
import zmq.asyncio

from serve_app.kvcache.events import DEFAULT_MAX_MESSAGE_BYTES, EngineLoad, KvEventPublisher
from serve_app.kvcache.vllm_block_hashes import external_hash

logger = logging.getLogger("ray.serve")

_REDIAL_S = 0.5  # from a dropped connection to vLLM's publisher to dialing it again


class VllmKvEventRelay:
    """vLLM's KV-cache events, under vLLM's block hashes, to the replica's publisher.

    vLLM publishes from its engine-core process. ``held`` is the engine's snapshot: every block
    it announced and has not removed since.

    A hybrid model (full and sliding-window attention, or Mamba layers) caches a block once per
    KV-cache group, under one hash: vLLM stores and removes it per group (``group_idx``). The
    routers are told of a block once, when its first group stores it, and of its removal when
    its last group removes it: a sliding-window group dropping the blocks behind its window does
    not make the routers forget what the full-attention group still holds. Copies count too:
    two requests that computed the same block at once leave two blocks under one hash, and
    vLLM removes them one at a time.

    The hop is one ZeroMQ PUB/SUB over an ``ipc://`` socket in a directory private to this
    replica (``mkdtemp``: its user only): no port to allocate, nothing reachable from outside
    the node, so no CURVE. It is capped all the same (``DEFAULT_MAX_MESSAGE_BYTES``: one engine
    step's batch is a few hundred kB even for a 128k-token prefill); libzmq drops a bigger
    batch with the connection and, after such a protocol error, does not dial again, so the
    relay does (``_redial``). A batch that does not decode is skipped: the relay outlives
    anything on its socket.
    """

    def __init__(self, events: KvEventPublisher, load: Callable[[], EngineLoad]) -> None:
        self._events = events
        self._load = load
        self._dir = tempfile.mkdtemp(prefix="forge-kv-")
        self.endpoint = f"ipc://{self._dir}/events"
        # vLLM's block → its copies in each group holding it
        self._groups: dict[int, dict[int | None, int]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._redialer: asyncio.Task | None = None
        self._next_seq = 0
        self.bad_batches = 0  # messages on the socket that were not a batch it could apply

    def vllm_config(self):
        from vllm.config import KVEventsConfig

        return KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self.endpoint,  # vLLM binds ipc endpoints, and this side connects
            replay_endpoint=None,
            topic="",
        )

    def start(self) -> None:
        if self._task is not None:
            return
        self._ctx = zmq.asyncio.Context()
        self._socket = self._ctx.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, DEFAULT_MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._socket.connect(self.endpoint)
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        self._redialer = loop.create_task(self._redial(monitor))

    def accepted(self, request_id: str) -> None:
        self._events.accepted(request_id)
        self.flush()

    def cleared(self) -> None:
        """The engine's cache was emptied (vLLM's own event comes with its next step's)."""
        self._groups.clear()
        self._events.cleared()
        self.flush()

    def flush(self) -> None:
        self._events.flush(self._load())

    async def _run(self) -> None:
        decode = self.batch_decoder()
        while True:
            frames = await self._socket.recv_multipart()
            try:
                _topic, seq, payload = frames
                seq = int.from_bytes(seq, "big")
                if seq != self._next_seq:  # dropped (HWM) or sent before this side subscribed
                    logger.warning("missed vLLM KV event batches %d to %d", self._next_seq, seq - 1)
                self._next_seq = seq + 1
                self.apply(decode(payload))
                self.flush()
            except Exception:  # one bad batch must not end the relay
                self.bad_batches += 1
                logger.exception("could not relay a vLLM KV event batch")

    async def _redial(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                await monitor.recv_multipart()  # a DISCONNECTED event: nothing else is asked
                await asyncio.sleep(_REDIAL_S)
                logger.warning("vLLM KV events: the connection dropped (a batch over the cap?)")
                with contextlib.suppress(zmq.ZMQError):
                    self._socket.disconnect(self.endpoint)
                self._socket.connect(self.endpoint)
        finally:
            self._socket.disable_monitor()
            monitor.close()

    def batch_decoder(self) -> Callable[[bytes], Iterable]:
        """A batch's payload to its events: vLLM's own decoder (imported here, lazily)."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        return lambda payload: decoder.decode(payload).events

    def apply(self, events: Iterable) -> None:
        for event in events:
            # By class name, not isinstance: vLLM's events are msgspec structs tagged with their
            # class name (tag=True), so the name is what vLLM sends and decodes by. Matching it
            # keeps this logic free of vLLM, runnable and tested where vLLM is not installed.
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                self._groups.clear()
                self._events.cleared()
            elif getattr(event, "medium", None) not in (None, "GPU"):
                continue  # an offload tier (CPU, storage): routers route on what the GPU holds
            elif kind == "BlockStored":
                self._events.stored(self._stored(event))
            elif kind == "BlockRemoved":
                self._events.removed(self._removed(event))

    @property
    def held(self) -> Collection[int]:
        """vLLM's blocks, as its events name them: the engine's snapshot."""
        return self._groups.keys()

    def _stored(self, event) -> list[int]:
        """The blocks no group held before."""
        group, new = getattr(event, "group_idx", None), []
        for block_hash in map(external_hash, event.block_hashes):
            groups = self._groups.get(block_hash)
            if groups is None:
                groups = self._groups[block_hash] = {}
                new.append(block_hash)
            groups[group] = groups.get(group, 0) + 1
        return new

    def _removed(self, event) -> list[int]:
        """The blocks whose last copy in their last group went."""
        group, gone = getattr(event, "group_idx", None), []
        for block_hash in map(external_hash, event.block_hashes):
            groups = self._groups.get(block_hash)
            if groups is None or group not in groups:
                continue
            groups[group] -= 1
            if not groups[group]:
                del groups[group]
            if not groups:
                del self._groups[block_hash]
                gone.append(block_hash)
        return gone

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._redialer) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._redialer = None
        if self._socket is not None:
            self._socket.close()
            self._ctx.term()
            self._socket = self._ctx = None
        self.remove_dir()

    def remove_dir(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)
