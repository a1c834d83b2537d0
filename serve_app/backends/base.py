"""The interface the dispatch stage sees: every backend streams lists of ready items.

Items are SSE frames (``bytes``, passed to the client untouched) and metadata (``dict``:
``{"replica": id}``, ``{"usage": {...}}``) that the gateway consumes. Keeping one shape for Serve
handles and external HTTP means dispatch, failover and metering have a single code path.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Protocol

from serve_app.engines.base import Kind


@dataclass(frozen=True, slots=True)
class Timeouts:
    """A backend's four timeouts. Each expiry is a 504 (or an SSE error event) and a failure.

    ``connect_s``: a replica or socket must take the request; ``first_token_s``: then start
    answering; ``idle_s``: then never go silent for longer; ``total_s``: and finish by then
    (a client may ask for less). A healthy 3-minute generation trips none of them.
    """

    connect_s: float = 5.0
    first_token_s: float = 30.0
    idle_s: float = 60.0
    total_s: float = 600.0


async def paced(source: AsyncIterator, first_s: float, idle_s: float, deadline: float, who: str):
    """``source``'s items, each waited for no longer than the first-token or idle timeout, and
    never past ``deadline`` (loop time). Only the wait is timed, never our consumer. (wait_for,
    not asyncio.timeout: around a Serve handle's await the latter did not fire here.)"""
    from serve_app import errors  # errors imports nothing of ours; keep base import-light

    loop = asyncio.get_running_loop()
    wait, what = first_s, "start answering"
    while True:
        try:
            item = await asyncio.wait_for(anext(source), max(min(wait, deadline - loop.time()), 0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            if loop.time() >= deadline:
                raise errors.upstream_timeout(f"{who} did not finish in time.") from None
            raise errors.upstream_timeout(f"{who} did not {what} in time.") from None
        yield item
        wait, what = idle_s, "keep answering"


# How long a replica waits for an aborted stream's usage to land (its abort runs as the gateway
# asks); the whole question is bounded a little above, then the gateway charges its estimate.
ABANDONED_WAIT_S = 1.0


class PoolControl(Protocol):
    """What dispatch may ask of a backend that is a pool of replicas (not of an external URL)."""

    def replica_count(self) -> int | None:
        """Replicas that can take a request now; None while unknown (not yet heard of)."""
        ...

    def wake(self) -> None:
        """Start a pool scaled to zero, in the background."""
        ...

    def avoid(self, request_id: str, replica_id: str) -> None:
        """Route this request's next attempt to any replica but ``replica_id``."""
        ...

    def take_routed(self, request_id: str) -> tuple[str, bool] | None:
        """The replica the request's attempt went to and whether it was that replica's probe
        (once; None if it was never routed)."""
        ...

    def take_offered(self, request_id: str) -> tuple[str, ...]:
        """Where an attempt never noted as routed may still have started, most likely first
        (once; empty if it was routed, or never reached the router)."""
        ...

    async def set_fault(self, spec: dict | None) -> dict[str, dict | None]:
        """Inject ``spec`` (``faults.FaultSpec``; None clears) on every replica of the pool:
        replica id → the spec it now has, or None if it could not be reached."""
        ...

    def engine_identity(self) -> str | None:
        """What the pool's replicas say they run (``PoolConfig.engine_identity``), when they
        agree; None before any has said or while they differ (a roll under way)."""
        ...

    async def abandoned_usage(
        self, request_id: str, replica_id: str, *, if_received: bool = False
    ) -> dict | None:
        """The engine's ``usage`` of a stream the gateway abandoned on ``replica_id`` (the
        client left, or it failed mid-way), or None if the replica cannot tell in time; with
        ``if_received``, None at once from a replica the request never reached."""
        ...


class Backend(Protocol):
    name: str  # the ``backend`` label in metrics, logs and ``x-forge-backend``
    pool: PoolControl | None  # a pool of replicas, or None for an external backend
    # The model that answers when it is not the one asked for (the fallback's upstream model):
    # usage is recorded, and priced, under it. None: the requested model answers.
    served_model: str | None
    kinds: Collection[Kind]  # the requests it serves: "chat", "completion", "embedding"

    def stream(
        self, body: dict, kind: Kind, request_id: str, budget_s: float | None = None
    ) -> AsyncIterator[list]:
        """Stream a request. Raise ``ForgeError`` before the first item for a clean failure.

        ``budget_s``: what is left of the request's total deadline (the client's, or what an
        earlier attempt left); the backend's own ``total_s`` applies when it is shorter.
        """
        ...

    async def complete(
        self, body: dict, kind: Kind, request_id: str, budget_s: float | None = None
    ) -> dict:
        """Serve a non-streaming request: ``{"response": <OpenAI body>, "replica": id | None}``."""
        ...

    async def ready(self) -> bool:
        """Whether the backend can take a request now (for ``/readyz``)."""
        ...
