"""Settles that land: a refund or a lease release retried until the store confirms it.

A settle is what a request owes its tenant's budget once it ends: the tokens reserved and not
used, the concurrent-stream lease it held. Lost to one store timeout, or skipped while the
store's breaker is open, it overcharges the tenant (``prompt + max_tokens``) and holds one of
its streams until the lease expires. So each is retried with backoff, through the store with
the patient timeout, until it lands or stops mattering (``deadline_s``: by then the lease has
expired and the bucket refilled by themselves). A refund carries an idempotency id
(``Store.adjust(once=...)``), so a retry after a lost reply is applied once; a release is
idempotent as it is. One ``Settles`` per gateway replica, kept across live rebuilds of the
pipeline (``LastingParts``), drained when the replica stops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from serve_app.stages.store_failures import StoreFailures
from serve_app.store import StoreError

Call = Callable[[], Awaitable[object]]


class Settles:
    def __init__(
        self,
        failed: StoreFailures,
        *,
        deadline_s: float = 120.0,
        first_backoff_s: float = 0.05,
        max_backoff_s: float = 5.0,
    ) -> None:
        self._failed = failed
        self.deadline_s = deadline_s
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self._pending: set[asyncio.Task] = set()
        self.given_up = 0  # settles that met the deadline unconfirmed (counted per op too)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def land(self, op: str, *calls: Call) -> asyncio.Task:
        """Run ``calls`` in the background, each retried until the store confirms it."""
        task = asyncio.get_running_loop().create_task(self._all(op, calls))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return task

    async def _all(self, op: str, calls: tuple[Call, ...]) -> None:
        if len(calls) == 1:  # the usual case: no gather, no task per call
            await self._until_landed(op, calls[0])
            return
        await asyncio.gather(*(self._until_landed(op, call) for call in calls))

    async def _until_landed(self, op: str, call: Call) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        delay = self.first_backoff_s
        while True:
            try:
                await call()
                return
            except StoreError as exc:
                self._failed(op, exc)
                if loop.time() + delay > deadline:
                    self.given_up += 1
                    self._failed(f"{op}_given_up", exc)
                    return
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.max_backoff_s)

    async def drain(self) -> None:
        """Wait for every settle under way (tests; a replica stopping)."""
        while self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

    async def aclose(self, wait_s: float = 5.0) -> None:
        """A stopping replica gives its settles ``wait_s`` to land, then cancels the rest."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.drain(), wait_s)
        for task in list(self._pending):
            task.cancel()
