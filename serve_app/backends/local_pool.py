"""A pool of in-process replicas: the real ``Replica`` and engine, called directly, no Serve.

The in-process twin of ``PoolBackend`` for a gateway served without Ray (tests through httpx's
``ASGITransport``, a profiler under uvicorn). Same items, same four timeouts, same
``PoolControl`` answers; replicas are taken in turn, skipping the one a retry must avoid and any
whose breaker is not closed. The routing policies run where they pay off, inside Serve's router
(``routing/serve_router.py``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence

from serve_app import errors
from serve_app.backends.base import ABANDONED_WAIT_S, Timeouts, paced
from serve_app.bridge import BridgedPool, PoolBridge, replica_backend
from serve_app.engines.base import EngineError, Kind
from serve_app.replica.server import Replica
from serve_app.resilience.breaker import State
from serve_app.tracing import carrier


class LocalPoolBackend(BridgedPool):
    def __init__(
        self,
        name: str,
        replicas: Sequence[Replica],
        timeouts: Timeouts,
        bridge: PoolBridge | None = None,
    ) -> None:
        super().__init__(name, bridge)
        self.timeouts = timeouts
        self.replicas = {r.replica_id: r for r in replicas}
        if len(self.replicas) != len(replicas):
            raise ValueError("local replicas need distinct replica_id values")
        self.bridge.replica_ids = frozenset(self.replicas)
        self._turn = itertools.count()

    def wake(self) -> None:
        """In-process replicas are never scaled to zero."""

    # -- Backend -----------------------------------------------------------------------------

    def _route(self, request_id: str) -> Replica:
        ids = sorted(self.replicas)
        avoid, breakers = self.bridge.avoid.get(request_id), self.bridge.breakers
        usable = [
            rid
            for rid in ids
            if rid != avoid
            and (
                breakers is None or breakers.state(replica_backend(self.name, rid)) is State.CLOSED
            )
        ] or ids  # never all excluded: the pool's own breaker keeps traffic away
        rid = usable[next(self._turn) % len(usable)]
        self.bridge.note_routed(request_id, rid, probe=False)
        return self.replicas[rid]

    def _deadline(self, budget_s: float | None) -> float:
        total = self.timeouts.total_s
        return asyncio.get_running_loop().time() + min(total, budget_s or total)

    async def stream(
        self, body: dict, kind: Kind, request_id: str, budget_s: float | None = None
    ) -> AsyncIterator[list]:
        replica = self._route(request_id)
        t = self.timeouts
        source = replica.stream(body, kind, request_id, carrier())
        try:
            async for batch in paced(
                source, t.first_token_s, t.idle_s, self._deadline(budget_s), "The model"
            ):
                yield batch
        except errors.ForgeError:
            raise
        except EngineError as exc:
            raise errors.bad_gateway(f"The model replica failed: {exc}") from exc
        finally:
            await source.aclose()  # the replica aborts the generation and frees its slot

    async def complete(
        self, body: dict, kind: Kind, request_id: str, budget_s: float | None = None
    ) -> dict:
        replica = self._route(request_id)
        timeout = max(self._deadline(budget_s) - asyncio.get_running_loop().time(), 0)
        try:
            answer = replica.complete(body, kind, request_id, carrier())
            return await asyncio.wait_for(answer, timeout)
        except TimeoutError:
            raise errors.upstream_timeout("The model did not finish answering in time.") from None
        except EngineError as exc:
            raise errors.bad_gateway(f"The model replica failed: {exc}") from exc

    async def set_fault(self, spec: dict | None) -> dict[str, dict | None]:
        return {rid: replica.set_fault(spec) for rid, replica in sorted(self.replicas.items())}

    async def abandoned_usage(
        self, request_id: str, replica_id: str, *, if_received: bool = False
    ) -> dict | None:
        replica = self.replicas.get(replica_id)
        if replica is None:
            return None
        return await replica.abandoned_usage(
            ABANDONED_WAIT_S, request_id=request_id, replica_id=replica_id, if_received=if_received
        )

    async def ready(self) -> bool:
        return bool(self.replicas)
