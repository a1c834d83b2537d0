"""A primary pool: a replica deployment reached through a Serve ``DeploymentHandle``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle

from serve_app import errors
from serve_app.engines.base import EngineError, Kind

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
        return errors.backend_unavailable("The model pool is at capacity; retry shortly.")
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


async def _resolve(response):
    return await response


class PoolBackend:
    def __init__(
        self,
        name: str,
        handle: DeploymentHandle,
        first_token_timeout_s: float,
        idle_timeout_s: float = 60.0,
        request_timeout_s: float = 600.0,
    ) -> None:
        self.name = name
        self._handle = handle
        self._stream = handle.options(stream=True)
        self._first_token_timeout_s = first_token_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._request_timeout_s = request_timeout_s

    async def stream(self, body: dict, kind: Kind, request_id: str) -> AsyncIterator[list]:
        gen = self._stream.stream.remote(body, kind, request_id)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._request_timeout_s
        wait, what = self._first_token_timeout_s, "start answering"
        finished = False
        try:
            while True:
                # The time to the first item, then between items, never past the total deadline;
                # only the wait is timed, never our consumer. (wait_for, not asyncio.timeout:
                # around a handle's await the latter did not fire here; the hang test hung.)
                try:
                    timeout = min(wait, deadline - loop.time())
                    batch = await asyncio.wait_for(gen.__anext__(), timeout)
                except StopAsyncIteration:
                    finished = True
                    return
                except TimeoutError:
                    raise errors.upstream_timeout(f"The model did not {what} in time.") from None
                yield batch
                wait, what = self._idle_timeout_s, "keep answering"
        except errors.ForgeError:
            raise
        except Exception as exc:  # Ray's errors, TaskCancelledError included, are Exceptions
            raise _as_forge_error(exc) from exc
        finally:
            if not finished:
                # Stopped early (client gone, failure, deadline): the replica aborts and frees
                # its slot. cancel() re-raises a failed assignment's error; it is handled above.
                with contextlib.suppress(Exception):
                    gen.cancel()

    async def complete(self, body: dict, kind: Kind, request_id: str) -> dict:
        response = self._handle.complete.remote(body, kind, request_id)
        try:
            return await asyncio.wait_for(_resolve(response), self._request_timeout_s)
        except asyncio.CancelledError:
            _cancel(response)
            raise
        except TimeoutError:
            _cancel(response)
            raise errors.upstream_timeout("The model did not finish answering in time.") from None
        except Exception as exc:
            raise _as_forge_error(exc) from exc

    async def ready(self) -> bool:
        try:
            await asyncio.wait_for(self._handle.stats.remote(), 2.0)
        except Exception:
            return False
        return True
