"""The concurrent-stream leases of a quota stage's live requests, renewed together.

A request's stream lease (``Store.acquire_lease``) lives ``ttl_s``, so a stream that runs longer
must renew it. Renewed one by one, that was a sleeping task and a store call per stream each
period: at thousands of open streams, thousands of tasks (issue 36). Here one task renews them
all with one ``Store.renew_leases`` round trip per store each third of the TTL, and runs only
while some lease is kept (it ends with the last one; the next lease starts it again).

A lease the store no longer holds (flushed, failed over) is acquired again for its live stream,
counted against the cap as before, rather than left running unseen. A store failure is counted
(``forge_store_errors_total{op="renew"}``) and the next period tries again. A lease is renewed
until its request drops it or its longest life has passed; then it lapses by itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass

from serve_app.stages.store_failures import StoreFailures
from serve_app.store import Store, StoreError


@dataclass(slots=True)
class KeptLease:
    store: Store  # the shared store, or the stage's local one while the shared one failed
    key: str
    lease_id: str
    limit: int  # the tenant's cap, for acquiring it again if the store lost it
    until: float  # when its renewals stop (on the keeper's clock)


class LeaseKeeper:
    def __init__(
        self,
        ttl_s: float,
        failed: StoreFailures,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self._failed = failed
        self._clock = clock
        self._kept: dict[str, KeptLease] = {}  # lease id → its lease
        self._task: asyncio.Task | None = None

    @property
    def kept(self) -> int:
        return len(self._kept)

    def keep(self, store: Store, key: str, lease_id: str, limit: int, max_life_s: float) -> None:
        """Renew a live request's lease from the next period on, for ``max_life_s`` at most."""
        self._kept[lease_id] = KeptLease(store, key, lease_id, limit, self._clock() + max_life_s)
        if self._task is None:
            # In no request's context: it outlives the request that started it.
            self._task = asyncio.get_running_loop().create_task(
                self._renew_while_kept(), context=contextvars.Context()
            )

    def drop(self, lease_id: str) -> None:
        """The request ended: its lease is released elsewhere (a settle) and renewed no more."""
        self._kept.pop(lease_id, None)

    async def renew_now(self) -> None:
        """One round trip per store renews every lease kept; the ones gone are acquired again."""
        now = self._clock()
        for lease_id in [i for i, lease in self._kept.items() if lease.until <= now]:
            del self._kept[lease_id]
        by_store: dict[Store, list[KeptLease]] = {}
        for lease in self._kept.values():
            by_store.setdefault(lease.store, []).append(lease)
        for store, leases in by_store.items():
            try:
                gone = await store.renew_leases([(x.key, x.lease_id) for x in leases], self.ttl_s)
            except StoreError as exc:
                self._failed("renew", exc)
                continue
            for _, lease_id in gone:
                await self._take_back(lease_id)

    async def _take_back(self, lease_id: str) -> None:
        """A live stream's lease the store lost, held again; not one whose request has ended
        meanwhile (its release may have crossed the renewal)."""
        lease = self._kept.get(lease_id)
        if lease is None:
            return
        try:
            await lease.store.acquire_lease(lease.key, lease_id, lease.limit, self.ttl_s)
            if lease_id not in self._kept:  # it ended during the call: give it back again
                await lease.store.release_lease(lease.key, lease_id)
        except StoreError as exc:
            self._failed("renew", exc)

    async def _renew_while_kept(self) -> None:
        try:
            while self._kept:
                await asyncio.sleep(self.ttl_s / 3)
                await self.renew_now()
        finally:
            self._task = None
