"""A primary pool: a replica deployment reached through a Serve ``DeploymentHandle``.

Its ``PoolControl`` answers come from the pool's bridge (``serve_app/bridge.py``), which the
pool's request router, running in this same process, keeps current.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve import context as serve_context
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app import errors
from serve_app.backends.base import ABANDONED_WAIT_S, Timeouts, paced
from serve_app.backends.stream_window import bound_stream_windows
from serve_app.bridge import BridgedPool, PoolBridge
from serve_app.config.models import PoolConfig
from serve_app.engines.base import EngineError, Kind
from serve_app.tracing import carrier

logger = logging.getLogger("ray.serve")

# Serve handles raise the replica's exception as a subclass of the original type, so a
# ForgeError raised in a replica (a 400 for an over-long prompt) reaches the client intact.
_UNAVAILABLE = (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError)


def _as_forge_error(exc: BaseException) -> errors.ForgeError:
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
        gen = self._stream.stream.remote(body, kind, request_id, carrier())
        t = self.timeouts
        deadline = asyncio.get_running_loop().time() + min(t.total_s, budget_s or t.total_s)
        finished = False
        try:
            await self._connect(gen, deadline)
            async for batch in paced(gen, t.first_token_s, t.idle_s, deadline, "The model"):
                yield batch
            finished = True
        except errors.ForgeError:
            raise
        except Exception as exc:  # Ray's errors, TaskCancelledError included, are Exceptions
            raise _as_forge_error(exc) from exc
        finally:
            if not finished:
                # Stopped early (client gone, failure, deadline): the replica aborts and frees
                # its slot. cancel() re-raises a failed assignment's error; it is handled above.
                _cancel(gen)

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
            raise _as_forge_error(exc) from exc
        errors.raise_if_refused(answer)
        return answer

    async def _connect(self, response, deadline: float) -> None:
        timeout = min(self.timeouts.connect_s, deadline - asyncio.get_running_loop().time())
        try:
            await asyncio.wait_for(_assigned(response), max(timeout, 0))
        except TimeoutError:
            raise errors.upstream_timeout("No model replica took the request in time.") from None

    async def set_fault(self, spec: dict | None) -> dict[str, dict | None]:
        """Each replica the router knows, by a call pinned to it."""
        return {
            replica_id: await self._pinned(
                replica_id, f"admin-fault-{uuid.uuid4().hex}", "set_fault", 10.0, spec
            )
            for replica_id in sorted(self.bridge.replica_ids or ())
        }

    async def abandoned_usage(self, request_id: str, replica_id: str) -> dict | None:
        """Asked of that very replica; None when it is gone or slow, and the gateway charges
        its estimate."""
        if not self.replica_count():
            return None  # no replica at all (it died mid-stream, the pool is at zero)
        return await self._pinned(
            replica_id, request_id, "abandoned_usage", ABANDONED_WAIT_S + 1.5, ABANDONED_WAIT_S
        )

    async def _pinned(self, replica_id: str, request_id: str, method: str, timeout_s: float, *args):
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
