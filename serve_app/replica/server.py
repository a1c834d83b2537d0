"""The replica deployment: one engine, served to the gateway through Serve handles.

The replica is engine-agnostic. It coalesces the frames that are ready into one handle item
(a Serve handle stream pays per item, not per byte), and, once a gateway holds a feed open here,
sends its streams' frames after the first batch over that feed, batched across streams
(``feed.py``); it injects faults, reports vLLM-named stats for routing and dashboards, and
aborts the engine's request when the caller goes away.

A stream's engine runs at most ``STREAM_QUEUE_ITEMS`` frames ahead of its caller: a slow reader
slows what is pulled from its own generation, never the others', and costs this process a
bounded queue, not the generation. The caller's pace reaches here because the gateway pulls its
handle stream only as its client takes the bytes, and in throughput-optimized mode (gRPC
between deployments, user code on the replica's loop: every config in ``configs/``) Serve pulls
this generator only as gRPC's flow control lets it write. (In Serve's default mode Serve drains
it into a queue of its own, in another thread, whatever the caller's pace.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator

from opentelemetry import trace
from ray import serve
from ray.serve.metrics import Gauge

from serve_app import errors
from serve_app.backends.pool import as_forge_error
from serve_app.config.models import PoolConfig, TracingConfig
from serve_app.engines.base import Engine, Kind, Usage
from serve_app.engines.truncation import TRUNCATE_KEY, fit_conversation
from serve_app.kvcache.curve import curve_keys
from serve_app.kvcache.events import KvEventPublisher
from serve_app.replica.autoscaling import OPEN_FEEDS
from serve_app.replica.faults import FaultInjector, FaultSpec
from serve_app.replica.feed import Feed
from serve_app.routing.registry import KV_EVENT_POLICIES
from serve_app.tracing import describe_usage, extract, tracer_for

logger = logging.getLogger("ray.serve")

_END = object()
# How many items (SSE frames, mostly) a stream's engine may run ahead of its caller here. A
# stream whose caller reads slowly fills this and its producer waits: the engine's stream is
# not pulled, and the engine keeps what it generated meanwhile as one merged output (vLLM's
# ``RequestOutputCollector``; the simulator models it), a few bytes a token, never a queue of
# frames. 64 frames are ~13 KiB and about a second of one sequence's tokens at typical decode
# rates: a gateway's pause of that long (a GC, a burst of other streams) costs no merging,
# while a caller that reads a byte a second costs this replica 64 frames, not a generation.
# Every coalesced batch is at most this long too. Not a setting: nothing it trades needs tuning.
STREAM_QUEUE_ITEMS = 64
# Request ids remembered as received: far more than a replica has in flight, and a question
# about a request comes right after it left.
RECEIVED_KEPT = 4096


def build_engine(pool: PoolConfig, kv_events: KvEventPublisher | None = None) -> Engine:
    """The pool's engine. Each is imported only when chosen: vLLM is an optional install.
    ``kv_events``: where the engine publishes its KV-cache events (KV-aware pools)."""
    if pool.engine.kind == "simulated":
        from serve_app.engines.simulated import SimulatedEngine

        return SimulatedEngine(
            pool.model,
            pool.engine,
            pool.default_max_tokens,
            kv_events,
            adapters=[a.name for a in pool.adapters],
        )
    if pool.engine.kind == "vllm":
        from serve_app.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            pool.model,
            pool.engine,
            pool.default_max_tokens,
            pool.task,
            kv_events,
            adapters=pool.adapters,
        )
    raise ValueError(f"unknown engine kind {pool.engine.kind!r}")


def _node_address() -> str:
    """Where this replica's KV event sockets listen: its node's address, which the gateways on
    other nodes can reach (127.0.0.1 on a laptop, where Ray itself stays on loopback)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit tests)
        return "127.0.0.1"


class Replica:
    """A model server. Stream items are lists: SSE frames (bytes) and metadata (dicts)."""

    def __init__(self, pool: dict, tracing: dict | None = None) -> None:
        self.pool = PoolConfig.model_validate(pool)
        self.engine_identity = self.pool.engine_identity()
        # The generation's span, a child of the gateway's dispatch span (when tracing is on).
        self.tracer = tracer_for(TracingConfig.model_validate(tracing or {}), "forge-replica")
        self.faults = FaultInjector()
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # constructed outside Serve (unit tests)
            self.replica_id = "local"
        # KV-aware routing learns where prompts are cached from the engine's own events.
        self.kv_events: KvEventPublisher | None = None
        if self.pool.routing.policy in KV_EVENT_POLICIES and self.pool.task == "generate":
            events = self.pool.routing.kv_events  # who may read them: docs/security.md
            self.kv_events = KvEventPublisher(
                self.replica_id,
                lambda: self.engine.cached_block_hashes(),
                _node_address(),
                keys=curve_keys(events.auth, events.curve_secret_env),
                pool=self.pool.name,
                max_message_bytes=events.max_message_bytes,
                snapshot_burst=events.snapshot_burst,
                snapshot_rate_per_s=events.snapshot_rate_per_s,
            )
        self.engine = build_engine(self.pool, self.kv_events)
        self._started = False
        self._gauges: dict | None = None
        self._lora_info: Gauge | None = None
        self._lora_loads: Gauge | None = None
        # Streams this replica is serving, from their first item until their generator closes:
        # the caller sees a stream end only after that, so this never counts one the gateway
        # has finished with (an engine counts a finished sequence until its next step).
        self.open_streams = 0
        # The generations of those streams by the gateway's request id, for ``abandoned_usage``.
        self._generations: dict[str, list[_Generation]] = {}
        # And the non-streamed generations by request id, for the same question.
        self._completions: dict[str, list[asyncio.Future]] = {}
        # The request ids of the last calls that came here, to tell at once a question about a
        # request that never did (``abandoned_usage(if_received=True)``).
        self._received: OrderedDict[str, None] = OrderedDict()
        # The feeds gateways hold open here, by the gateway's feed id (``feed``).
        self._feeds: dict[str, Feed] = {}

    async def _ensure_started(self) -> None:
        if not self._started:
            await self.engine.start()
            if self.kv_events is not None:
                self.kv_events.start()
            self._started = True

    async def _fitted(self, body: dict) -> dict:
        """``body`` as the engine is to serve it: a conversation the gateway asked to have
        truncated fitted to the engine's window (``engines/truncation.py``)."""
        if TRUNCATE_KEY not in body:
            return body
        engine = self.engine
        return await fit_conversation(
            body, engine.context_window, engine.default_max_tokens, engine.count_prompt
        )

    async def stream(
        self,
        body: dict,
        kind: Kind,
        request_id: str,
        trace_context: dict | None = None,
        feed_id: str | None = None,
        feed_key: str | None = None,
    ) -> AsyncIterator[list]:
        """Stream one request as lists of ready items; the first list starts with metadata.
        A refusal (a 4xx, before any frame) is the one item of the one list
        (``errors.refusal_item``), never an exception Serve would log with its message.

        With ``feed_id`` naming a feed its gateway holds open here (``feed``), only the first
        list comes back this way (its metadata says ``fed``); the rest, and the stream's end,
        go over the feed under ``feed_key``, and this call returns once they are sent."""
        self._note_received(request_id)
        source = self._stream(body, kind, request_id, trace_context, feed_id, feed_key)
        try:
            async for batch in source:
                yield batch
        except errors.ForgeError as err:
            if err.status >= 500:
                raise
            yield [errors.refusal_item(err)]
        finally:
            await source.aclose()

    async def _stream(
        self,
        body: dict,
        kind: Kind,
        request_id: str,
        trace_context: dict | None,
        feed_id: str | None = None,
        feed_key: str | None = None,
    ) -> AsyncIterator[list]:
        # Joined before any await: a feed with a stream on it does not end for being idle.
        feed = self._feeds.get(feed_id) if feed_id and feed_key else None
        gate = feed.join(feed_key) if feed is not None else None
        self.open_streams += 1
        try:
            with self._span(trace_context, request_id) as span:
                await self._ensure_started()
                await self.faults.before_first_frame()
                body = await self._fitted(body)
                generation = _Generation(
                    request_id, self.engine.stream(body, kind, request_id), self.engine.abandoned
                )
                queue = generation.queue
                self._generations.setdefault(request_id, []).append(generation)
                sent = 0
                first = True  # the first list goes back over the handle, fed or not
                try:
                    meta = {"replica": self.replica_id}
                    if feed is not None:
                        meta["fed"] = True
                    batch: list = [meta]
                    while True:
                        if gate is not None and not gate.is_set():
                            await gate.wait()  # its reader at the gateway is behind
                        item = await queue.get()
                        ended = False
                        while True:
                            if item is _END:
                                ended = True
                                break
                            if isinstance(item, BaseException):
                                raise item
                            if isinstance(item, Usage):
                                usage = item.to_openai()
                                batch.append({"usage": usage})
                                describe_usage(span, usage)
                            else:
                                batch.append(item)
                                sent += 1
                                self.faults.after_frame(sent)
                            if queue.empty():
                                break
                            item = queue.get_nowait()
                        if first or feed is None:
                            if batch:
                                yield batch
                        elif batch:
                            await feed.room()  # a feed backed up holds the stream here
                            feed.send(feed_key, batch)
                        if ended:
                            if feed is not None:
                                feed.send(feed_key, None)
                            generation.usage = None  # resumed after its batch: taken
                            return
                        first = False
                        batch = []
                except Exception as exc:
                    if feed is None or first or feed.closed:
                        raise
                    # Its reader is at the other end of the feed: the error goes in order,
                    # after the frames before it, as the gateway makes it of a handle's.
                    span.set_attribute("forge.error", type(exc).__name__)
                    feed.send(feed_key, errors.refusal_item(as_forge_error(exc)))
                finally:
                    # Caller gone (client disconnect, cancel) or done: abort and free the slot now.
                    generation.end()
                    live = self._generations.get(request_id, [])
                    if generation in live:
                        live.remove(generation)
                    if not live:
                        self._generations.pop(request_id, None)
        finally:
            self.open_streams -= 1
            if feed is not None:
                feed.leave(feed_key)

    async def feed(
        self, feed_id: str, *, replica_id: str | None = None, request_id: str | None = None
    ) -> AsyncIterator[list]:
        """The feed of gateway ``feed_id`` (``serve_app/replica/feed.py``): every frame after
        the first batch of its streams that name it, batched. A gateway opens one per replica
        it streams from, pinned here by ``replica_id``; another replica (that one is gone) ends
        it at once, and the gateway's streams stay on their handles."""
        if replica_id is not None and replica_id != self.replica_id:
            return
        feed = Feed(feed_id)
        previous = self._feeds.get(feed_id)
        if previous is not None:
            previous.close()  # one feed per gateway: the newer one
        self._feeds[feed_id] = feed
        try:
            async for batch in feed.items():
                yield batch
        finally:
            feed.close()
            if self._feeds.get(feed_id) is feed:
                del self._feeds[feed_id]

    def feed_pause(
        self,
        feed_id: str,
        feed_key: str,
        paused: bool,
        turn: int,
        *,
        replica_id: str | None = None,
        request_id: str | None = None,
    ) -> bool | None:
        """A fed stream's reader at the gateway is behind (``paused``) or caught up: the stream
        waits, as a handle stream waits for gRPC's flow control, and its engine output merges
        meanwhile (``_Generation``). None from another replica or for a feed not here."""
        if replica_id is not None and replica_id != self.replica_id:
            return None
        feed = self._feeds.get(feed_id)
        return None if feed is None else feed.pause(feed_key, paused, turn)

    async def complete(
        self, body: dict, kind: Kind, request_id: str, trace_context: dict | None = None
    ) -> dict:
        """The OpenAI response body (with ``usage``) and, under ``forge``, the replica id."""
        self._note_received(request_id)
        with self._span(trace_context, request_id) as span:
            await self._ensure_started()
            await self.faults.before_first_frame()
            body = await self._fitted(body)
            # A task of its own, so the gateway's ``abandoned_usage`` can end it at once (as it
            # ends a stream) rather than wait for Serve's cancellation; the engine records
            # what an ended generation cost. Cancelling this call cancels the task too.
            generation = asyncio.ensure_future(self.engine.complete(body, kind, request_id))
            running = self._completions.setdefault(request_id, [])
            running.append(generation)
            try:
                response, _ = await generation
            finally:
                running.remove(generation)
                if not running:
                    self._completions.pop(request_id, None)
            self.faults.after_frame(self.faults.spec.after_frames)
            describe_usage(span, response.get("usage"))
            return {"response": response, "replica": self.replica_id}

    @contextlib.contextmanager
    def _span(self, trace_context: dict | None, request_id: str) -> Iterator[trace.Span]:
        """A span for this generation when the gateway sent a trace context (else a no-op)."""
        if self.tracer is None or not trace_context:
            yield trace.INVALID_SPAN
            return
        # Not made current: a stream's generator is resumed (and closed) from other contexts.
        span = self.tracer.start_span(
            "forge.replica.generate",
            context=extract(trace_context),
            attributes={
                "forge.replica": self.replica_id,
                "forge.pool": self.pool.name,
                "forge.engine": self.pool.engine.kind,
                "forge.request_id": request_id,
            },
        )
        try:
            yield span
        except GeneratorExit:
            span.set_attribute("forge.aborted", True)  # the caller left: generation aborted
            raise
        except Exception as exc:
            span.set_attribute("forge.error", type(exc).__name__)
            raise
        finally:
            span.end()

    async def complete_streamed(
        self, body: dict, kind: Kind, request_id: str, trace_context: dict | None = None
    ):
        """``complete`` as a one-item stream, which is how the gateway calls it.

        Serve learns that a replica accepted a call from the call's first response metadata;
        on a unary call (throughput-optimized mode, gRPC) that arrives with the answer, so a
        long non-streaming generation would look "not yet assigned" for its whole duration,
        and a hung one could not be charged to its replica. A stream announces itself at once.
        """
        try:
            yield await self.complete(body, kind, request_id, trace_context)
        except errors.ForgeError as err:
            if err.status >= 500:
                raise
            yield errors.refusal_item(err)  # see ``stream``

    def _note_received(self, request_id: str) -> None:
        self._received[request_id] = None
        if len(self._received) > RECEIVED_KEPT:
            self._received.popitem(last=False)

    async def abandoned_usage(
        self,
        wait_s: float = 1.0,
        *,
        request_id: str,
        replica_id: str | None = None,
        if_received: bool = False,
    ) -> dict | None:
        """What an aborted generation of this replica cost (OpenAI ``usage``), once: the
        gateway asks right after its client left (mid-stream, or before a non-streamed answer
        came), to charge exactly what the engine produced. Asked of another replica (the one
        that served it is gone), None at once; and so with ``if_received``, asked of each
        replica a request may have started on, where it never came."""
        if replica_id is not None and replica_id != self.replica_id:
            return None
        if if_received and request_id not in self._received:
            return None
        # The gateway has closed its end; Serve's cancellation of this stream may still be on
        # its way (or, for a stream parked at a ``yield``, not come until much later). Asked
        # now, the generation ends now, so its cost is known within the wait, not after it.
        for generation in list(self._generations.get(request_id, ())):
            generation.end()
        for completion in list(self._completions.get(request_id, ())):
            completion.cancel()
        usage = await self.engine.abandoned.collect(request_id, wait_s)
        return None if usage is None else usage.to_openai()

    async def ready(self) -> str:
        """The warm-up call a gateway sends to a pool scaled to zero: it waits at the handle,
        so Serve's autoscaler starts a replica, and returns once the engine is loaded."""
        await self._ensure_started()
        return self.replica_id

    def stats(self) -> dict:
        return {
            "replica": self.replica_id,
            "open_streams": self.open_streams,
            "open_feeds": len(self._feeds),
            **self.engine.stats().as_dict(),
        }

    async def record_autoscaling_stats(self) -> dict[str, int]:
        """Serve calls this periodically where the pool autoscales: its policy takes the feeds
        open here off the ongoing requests it counts (``replica/autoscaling.py``)."""
        return {OPEN_FEEDS: len(self._feeds)}

    async def record_routing_stats(self) -> dict:
        """Serve calls this periodically; request routers read it (see ``routing/``). The same
        numbers go to the engine gauges, so dashboards see what routers see."""
        stats = self.engine.stats().as_dict()
        self._export(stats)
        if self.kv_events is not None:
            # Routers subscribe where this says, so the publisher beats and answers snapshots
            # from here on, before the engine's first request: an idle replica is not a dead one.
            self.kv_events.start()
            stats["kv_events"] = self.kv_events.describe()
        # Cache keys: a gateway whose pool runs in another application learns it here.
        stats["engine_identity"] = self.engine_identity
        # How the engine names blocks (vLLM's seed and block size): routers follow it.
        hashing = self.engine.block_hashing()
        if hashing is not None:
            stats["block_hashing"] = hashing
        return stats

    def _export(self, stats: dict) -> None:
        if self._gauges is None:
            self._gauges = {
                name: Gauge(f"forge_engine_{name}", description=f"vLLM's {name}, per replica.")
                for name in (
                    "num_requests_running",
                    "num_requests_waiting",
                    "kv_cache_usage_perc",
                    "prefix_cache_queries",
                    "prefix_cache_hits",
                )
            }
        for name, gauge in self._gauges.items():
            gauge.set(stats[name])
        if stats.get("max_loras"):
            self._export_lora(stats)

    def _export_lora(self, stats: dict) -> None:
        """vLLM's ``vllm:lora_requests_info``: the adapters running and waiting, as labels, on
        a gauge whose value is when it was said (a dashboard shows the latest)."""
        if self._lora_info is None:
            self._lora_info = Gauge(
                "forge_engine_lora_requests_info",
                description="Running and waiting LoRA adapters, per replica (as vLLM's).",
                tag_keys=("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
            )
            self._lora_loads = Gauge(
                "forge_engine_lora_loads", description="LoRA adapters loaded, per replica."
            )
        self._lora_info.set(
            time.time(),
            tags={
                "max_lora": str(stats["max_loras"]),
                "running_lora_adapters": ",".join(sorted(stats["running_lora_adapters"])),
                "waiting_lora_adapters": ",".join(sorted(stats["waiting_lora_adapters"])),
            },
        )
        self._lora_loads.set(stats["lora_loads"])

    def set_fault(
        self, spec: dict | None, *, replica_id: str | None = None, request_id: str | None = None
    ) -> dict | None:
        """Inject (or with None clear) a fault. Through a pool's handle (``POST /admin/faults``)
        the call names its replica, routed there by ``request_id``; another replica that gets it
        (the named one is gone) changes nothing and answers None."""
        if replica_id is not None and replica_id != self.replica_id:
            return None
        self.faults.spec = FaultSpec.model_validate(spec or {})
        set_slow = getattr(self.engine, "set_slow_factor", None)
        if set_slow is not None:
            set_slow(self.faults.spec.factor if self.faults.spec.mode == "slow" else 1.0)
        logger.warning("fault injection on replica %s: %s", self.replica_id, self.faults.spec)
        return self.faults.spec.model_dump()

    async def check_health(self) -> None:
        await self.engine.check_health()

    async def __del__(self) -> None:
        await self.engine.shutdown()
        if self.kv_events is not None:
            await self.kv_events.close()


class _Generation:
    """One stream's engine task, the bounded queue it fills, and the engine's final ``Usage``
    until its caller has taken it.

    The producer task pulls the engine's stream into ``queue`` (``STREAM_QUEUE_ITEMS`` long) and
    waits while it is full: a caller's pace is the stream's pace. ``usage`` is set as soon as the
    engine yields it, before it is queued, and cleared by the consumer once the batch carrying it
    was taken; so a usage waiting for room, queued, or in the batch the caller left at is never
    lost.

    ``end`` runs once, from whichever comes first: the stream's own close or the gateway's
    ``abandoned_usage``. A running generation is aborted (the engine records what it cost);
    a finished one whose usage never reached the caller has that usage recorded as an abort's
    would be. The two cannot both happen: an engine reports usage only for a generation that
    finished, an abort only for one that did not.
    """

    def __init__(self, request_id: str, items: AsyncIterator, abandoned) -> None:
        self.request_id = request_id
        self.abandoned = abandoned
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=STREAM_QUEUE_ITEMS)
        self.usage: Usage | None = None
        self.ended = False
        self.producer = asyncio.create_task(self._produce(items))

    async def _produce(self, items: AsyncIterator) -> None:
        queue = self.queue
        try:
            # Closed here, however this ends: a producer cancelled while it waits for room is
            # outside the engine's stream, which must still abort now, not when it is collected.
            async with contextlib.aclosing(items):
                async for item in items:
                    if isinstance(item, Usage):
                        self.usage = item
                    await queue.put(item)  # waits while the caller is this far behind
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced to the consumer, which re-raises it
            await queue.put(exc)
        await queue.put(_END)

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.producer.cancel()
        undelivered, self.usage = self.usage, None
        if undelivered is not None:
            self.abandoned.record(self.request_id, undelivered)
        # What the caller left unread goes, so _END fits: a consumer still waiting returns.
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(_END)
