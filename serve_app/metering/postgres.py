"""The usage ledger in PostgreSQL: the cluster's (Cloud SQL, ``terraform/``), with backups.

``asyncpg`` with a small pool, connected lazily (a gateway starts while the database is still
coming up, and its writes wait and retry). A batch is one transaction: claim its id, then add
every count with ``INSERT ... ON CONFLICT DO UPDATE``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from serve_app.metering.book import (
    BATCH_MEMORY_S,
    PRUNE_EVERY,
    SCHEMA,
    BookError,
    UsageBook,
    UsageEntry,
    oldest_kept_day,
)

_UPSERT = (
    "INSERT INTO forge_usage (tenant, day, model, counter, value) VALUES ($1, $2, $3, $4, $5) "
    "ON CONFLICT (tenant, day, model, counter) "
    "DO UPDATE SET value = forge_usage.value + excluded.value"
)


class PostgresBook(UsageBook):
    def __init__(
        self,
        dsn: str,
        *,
        retention_days: int = 400,
        timeout_s: float = 10.0,
        max_connections: int = 4,
    ) -> None:
        self.dsn = dsn
        self.retention_days = retention_days
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._pool = None
        self._connecting = asyncio.Lock()
        self._written = 0

    async def _pool_or_connect(self):
        import asyncpg

        async with self._connecting:
            if self._pool is None:
                pool = await asyncpg.create_pool(
                    self.dsn,
                    min_size=1,
                    max_size=self.max_connections,
                    timeout=self.timeout_s,
                    command_timeout=self.timeout_s,
                )
                async with pool.acquire() as db:
                    # Two gateways starting at once: the schema is created once.
                    async with db.transaction():
                        await db.execute("SELECT pg_advisory_xact_lock(7318140612)")
                        for statement in SCHEMA:
                            await db.execute(statement)
                self._pool = pool
        return self._pool

    async def _run(self, work):
        import asyncpg

        try:
            pool = await self._pool_or_connect()
            async with pool.acquire() as db:
                return await work(db)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
            raise BookError(f"postgres: {type(exc).__name__}: {exc}") from exc

    async def write(self, batch_id: str, entries: Sequence[UsageEntry]) -> bool:
        async def work(db) -> bool:
            async with db.transaction():
                claimed = await db.fetchval(
                    "INSERT INTO forge_usage_batches (batch_id, written_at) VALUES ($1, $2) "
                    "ON CONFLICT (batch_id) DO NOTHING RETURNING 1",
                    batch_id,
                    time.time(),
                )
                if claimed is None:
                    return False
                # Sorted: two gateways' batches lock rows in one order, never a deadlock.
                await db.executemany(_UPSERT, sorted(tuple(e) for e in entries))
            self._written += 1
            if self._written % PRUNE_EVERY == 0:
                await self._prune(db)
            return True

        return await self._run(work)

    async def prune(self) -> None:
        await self._run(self._prune)

    async def _prune(self, db) -> None:
        await db.execute(
            "DELETE FROM forge_usage_batches WHERE written_at < $1", time.time() - BATCH_MEMORY_S
        )
        await db.execute(
            "DELETE FROM forge_usage WHERE day < $1", oldest_kept_day(self.retention_days)
        )

    async def read(self, tenants: Sequence[str], first_day: str, last_day: str) -> list[UsageEntry]:
        if not tenants:
            return []

        async def work(db) -> list[UsageEntry]:
            rows = await db.fetch(
                "SELECT tenant, day, model, counter, value FROM forge_usage "
                "WHERE tenant = ANY($1::text[]) AND day >= $2 AND day <= $3",
                list(tenants),
                first_day,
                last_day,
            )
            return [UsageEntry(*row) for row in rows]

        return await self._run(work)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
