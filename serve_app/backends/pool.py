"""A primary pool: a replica deployment reached through a Serve ``DeploymentHandle``.

Its ``PoolControl`` answers come from the pool's bridge (``serve_app/bridge.py``), which the
pool's request router, running in this same process, keeps current.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import uuid
from collections.abc import AsyncIterator

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app import errors
from serve_app.backends.base import ABANDONED_WAIT_S, Timeouts, paced
from serve_app.backends.feed import FedStream, demultiplex
from serve_app.backends.stream_window import bound_stream_windows
from serve_app.bridge import BridgedPool, PoolBridge
from serve_app.config.models import PoolConfig
from serve_app.engines.base import EngineError, Kind
from serve_app.tracing import carrier

logger = logging.getLogger("ray.serve")

# Serve handles raise the replica's exception as a subclass of the original type, so a
# ForgeError raised in a replica (a 400 for an over-long prompt) reaches the client intact.
_UNAVAILABLE = (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError)


def as_forge_error(exc: BaseException) -> errors.ForgeError:
    """What a client is told of an exception a pool call raised (or a fed stream met)."""
    if isinstance(exc, errors.ForgeError):
        return errors.ForgeError(
            exc.status,
            exc.message,
            type=exc.type,
            code=exc.code,
            param=exc.param,
            headers=exc.headers,
        )
    if isinstance(exc, BackPressureError):
        return errors.at_capacity("The model pool is at capacity; retry shortly.")
    if isinstance(exc, _UNAVAILABLE):
        return errors.bad_gateway("The model replica went away.")
    if isinstance(exc, TimeoutError):
        return errors.upstream_timeout("The model did not start answering in time.")
    if isinstance(exc, EngineError):
        return errors.bad_gateway(f"The model replica failed: {exc}")
    return errors.bad_gateway()


def _cancel(response) -> None:
    """The caller gave up: the replica aborts the generation and frees its slot."""
    with contextlib.suppress(Exception):
        response.cancel()


def outside_the_request(call, *args, **kwargs):
    """``call(*args, **kwargs)`` made as nobody's child call.

    Serve cancels a cancelled request's child calls still waiting for a replica
    (``Replica._on_request_cancelled``), and a call made in the request's context is its child.
    The calls made because a request ended (what its aborted stream cost) are made just as Serve
    cancels it when its client left, and were cancelled with it: the tenant was charged an
    estimate. Made with Serve's request context unset, they are not the request's.
    """
    detached = contextvars.copy_context()
    detached.run(serve_context._serve_request_context.set, None)
    return detached.run(call, *args, **kwargs)


async def _assigned(response) -> None:
    """Resolves once Serve has handed the request to a replica: the end of "connect".

    Serve's response exposes assignment only through a private coroutine; without it (another
    Ray version) the connect phase simply merges into the first-token wait.
    """
    fetch = getattr(response, "_fetch_future_result_async", None)
    if fetch is not None:
        await fetch()


async def _watch(gen, fed: FedStream) -> None:
    """A fed stream's handle: it ends once the replica sent the stream's end over the feed, or
    fails (the replica died, the call was refused); a failure reaches the stream's reader.
    It carries nothing after the first batch (``Replica._stream``)."""
    try:
        async for _ in gen:
            pass
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        fed.fail(as_forge_error(exc))


def pool_timeouts(pool: PoolConfig) -> Timeouts:
    return Timeouts(
        pool.connect_timeout_s,
        pool.first_token_timeout_s,
        pool.idle_timeout_s,
        pool.request_timeout_s,
    )


class PoolBackend(BridgedPool):
    def __init__(
        self,
        name: str,
        handle: DeploymentHandle,
        timeouts: Timeouts,
        bridge: PoolBridge | None = None,
    ) -> None:
        super().__init__(name, bridge)
        bound_stream_windows()  # before the handle opens its first channel
        self.timeouts = timeouts
        self._handle = handle
        self._stream = handle.options(stream=True)  # also starts the router's replica updates
        self._waking: asyncio.Task | None = None
        # This gateway replica's feeds, one per pool replica, and their streams by key.
        self._feed_id = uuid.uuid4().hex
        self._feeds: dict[str, asyncio.Task] = {}
        self._fed: dict[str, FedStream] = {}
        self._keys = itertools.count()
        # Usage that came over a feed for a stream its client left first (``abandoned_usage``).
        self._unread_usage: dict[str, dict] = {}
        self._tasks: set[asyncio.Task] = set()  # watchers and pause calls (``_background``)

    def wake(self) -> None:
        """Wake a pool scaled to zero: one call that waits at the handle makes Serve's
        autoscaler start a replica, while clients are served elsewhere."""
        if self._waking is None or self._waking.done():
            self._waking = asyncio.get_running_loop().create_task(self._warm_up())

    async def _warm_up(self) -> None:
        try:
            replica = await self._handle.ready.remote()
            logger.info("pool %s is warm (replica %s)", self.name, replica)
        except Exception as exc:
            logger.warning("waking pool %s failed: %s", self.name, type(exc).__name__)

    async def stream(
        self, body: dict, kind: Kind, request_id: str, budget_s: float | None = None
    ) -> AsyncIterator[list]:
        key = f"{next(self._keys):x}"
        fed = FedStream(lambda paused, turn: self._pause(fed, key, paused, turn))
        self._fed[key] = fed
        gen = self._stream.stream.remote(body, kind, request_id, carrier(), self._feed_id, key)
        t = self.timeouts
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(t.total_s, budget_s or t.total_s)
        finished = False
        watcher: asyncio.Task | None = None
        try:
            await self._connect(gen, deadline)
            wait = max(min(t.first_token_s, deadline - loop.time()), 0)
            try:
                first = await asyncio.wait_for(anext(gen), wait)
            except StopAsyncIteration:
                finished = True
                return
            except TimeoutError:
                raise errors.upstream_timeout(
                    "The model did not start answering in time."
                ) from None
            meta = first[0] if first and type(first[0]) is dict else {}
            fed.replica = meta.get("replica")
            if not meta.get("fed"):
                if fed.replica is not None:
                    self._open_feed(fed.replica)  # for the streams after this one
                yield first
                async for batch in paced(gen, t.idle_s, t.idle_s, deadline, "The model"):
                    yield batch
                finished = True
                return
            # The rest comes over the feed; the handle's own end (or error) is watched beside.
            watcher = self._background(_watch(gen, fed))
            yield first
            async for batch in fed.batches(t.idle_s, deadline):
                yield batch
            finished = True
        except errors.ForgeError:
            raise
        except Exception as exc:  # Ray's errors, TaskCancelledError included, are Exceptions
            raise as_forge_error(exc) from exc
        finally:
            self._fed.pop(key, None)
            fed.close()
            if not finished:
                # Stopped early (client gone, failure, deadline): the replica aborts and frees
                # its slot. cancel() re-raises a failed assignment's error; it is handled above.
                _cancel(gen)
                self._note_unread_usage(request_id, fed)
                if watcher is not None:
                    watcher.cancel()
            # Else the watcher sees the handle's end, which follows the stream's over the feed.

    async def complete(
        self, body: dict, kind: Kind, request_id: str, budget_s: float | None = None
    ) -> dict:
        # Streamed, even for one answer: see ``Replica.complete_streamed``.
        response = self._stream.complete_streamed.remote(body, kind, request_id, carrier())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.timeouts.total_s, budget_s or self.timeouts.total_s)
        try:
            await self._connect(response, deadline)
            answer = await asyncio.wait_for(anext(response), max(deadline - loop.time(), 0))
        except asyncio.CancelledError:
            _cancel(response)
            raise
        except TimeoutError:
            _cancel(response)
            raise errors.upstream_timeout("The model did not finish answering in time.") from None
        except Exception as exc:
            _cancel(response)
            raise as_forge_error(exc) from exc
        errors.raise_if_refused(answer)
        return answer

    async def _connect(self, response, deadline: float) -> None:
        timeout = min(self.timeouts.connect_s, deadline - asyncio.get_running_loop().time())
        try:
            await asyncio.wait_for(_assigned(response), max(timeout, 0))
        except TimeoutError:
            raise errors.upstream_timeout("No model replica took the request in time.") from None

    # -- feeds (``serve_app/backends/feed.py``) -----------------------------------------------

    def _open_feed(self, replica_id: str) -> None:
        """Open this gateway's feed from ``replica_id`` in the background, once."""
        if replica_id not in self._feeds and replica_id in (self.bridge.replica_ids or ()):
            task = asyncio.get_running_loop().create_task(self._read_feed(replica_id))
            self._feeds[replica_id] = task

    async def _read_feed(self, replica_id: str) -> None:
        """Hand each fed stream its batches until the feed ends: the replica found it idle, or
        went away (its fed streams then fail here, if their handles did not fail first)."""
        pin = f"feed-{uuid.uuid4().hex}"
        self.bridge.pinned[pin] = replica_id
        try:
            gen = outside_the_request(
                self._stream.feed.remote, self._feed_id, replica_id=replica_id, request_id=pin
            )
            try:
                # Not timed: a replica at capacity takes it when a slot frees, and a call
                # cancelled before Serve assigned it blocks the loop (``_pinned``).
                await _assigned(gen)
            finally:
                self.bridge.pinned.pop(pin, None)
            streams = self._fed
            async for batch in gen:
                demultiplex(batch, streams)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.info("the feed from %s/%s ended: %r", self.name, replica_id, exc)
        finally:
            if self._feeds.get(replica_id) is asyncio.current_task():
                del self._feeds[replica_id]
            gone = errors.bad_gateway("The model replica went away.")
            for fed in list(self._fed.values()):
                if fed.replica == replica_id:
                    fed.fail(gone)

    def _pause(self, fed: FedStream, key: str, paused: bool, turn: int) -> None:
        """Ask the stream's replica to pause (or resume) it, in the background."""
        if fed.replica is None:
            return
        pin, args = f"feed-pause-{key}-{turn}", (self._feed_id, key, paused, turn)
        self._background(self._pinned(fed.replica, pin, "feed_pause", 10.0, *args))

    def _background(self, coroutine) -> asyncio.Task:
        """A task kept referenced until it ends (the loop holds only weak references)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _note_unread_usage(self, request_id: str, fed: FedStream) -> None:
        usage = fed.unread_usage()
        if usage is not None:
            if len(self._unread_usage) >= 1_000:
                self._unread_usage.clear()  # never asked: bounded, not kept
            self._unread_usage[request_id] = usage

    async def set_fault(self, spec: dict | None) -> dict[str, dict | None]:
        """Each replica the router knows, by a call pinned to it; all at once, so a drill's
        admin call waits for its slowest replica (a busy one's slot), not for their sum."""
        replica_ids = sorted(self.bridge.replica_ids or ())
        answers = await asyncio.gather(
            *(
                self._pinned(r, f"admin-fault-{uuid.uuid4().hex}", "set_fault", 10.0, spec)
                for r in replica_ids
            )
        )
        return dict(zip(replica_ids, answers, strict=True))

    async def abandoned_usage(
        self, request_id: str, replica_id: str, *, if_received: bool = False
    ) -> dict | None:
        """Asked of that very replica; None when it is gone or slow, and the gateway charges
        its estimate."""
        unread = self._unread_usage.pop(request_id, None)
        if unread is not None:
            return unread  # it came over the feed; the client left before it was read
        if not self.replica_count():
            return None  # no replica at all (it died mid-stream, the pool is at zero)
        return await self._pinned(
            replica_id,
            request_id,
            "abandoned_usage",
            ABANDONED_WAIT_S + 1.5,
            ABANDONED_WAIT_S,
            if_received=if_received,
        )

    async def _pinned(
        self, replica_id: str, request_id: str, method: str, timeout_s: float, *args, **options
    ):
        """``method(*args, replica_id=, request_id=)`` on that replica: the pool's router obeys
        ``bridge.pinned``; None if it fails or is late.

        Made outside the request that asks (``outside_the_request``), whose end it follows.
        A call is never left waiting for a replica that is gone: the router then sends it to
        any replica, which answers None for a replica id not its own. And it is not cancelled
        when late: cancelling a call Serve has not yet assigned waits for the assignment,
        blocking the event loop (``DeploymentResponse.cancel``); the replica methods answer
        within their own bound anyway.
        """
        self.bridge.pinned[request_id] = replica_id
        try:
            call = outside_the_request(
                getattr(self._handle, method).remote,
                *args,
                replica_id=replica_id,
                request_id=request_id,
                **options,
            )
            return await asyncio.wait_for(asyncio.shield(call), timeout_s)
        except Exception as exc:  # TimeoutError, the replica died
            logger.info("%s on %s/%s failed: %r", method, self.name, replica_id, exc)
            return None
        finally:
            self.bridge.pinned.pop(request_id, None)

    async def ready(self) -> bool:
        """Whether a replica is up now. Never sends a request: that would wake a cold pool."""
        return bool(self.replica_count())
