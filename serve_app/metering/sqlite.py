"""The usage ledger in a SQLite file: durable on a laptop, with no server to run.

The standard library's ``sqlite3`` in a worker thread (its calls block), one connection behind
a lock. WAL mode lets the reports read while a gateway writes, and a busy timeout lets two
processes (a second gateway replica, ``forge usage`` on the file) share it.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path

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
    "INSERT INTO forge_usage (tenant, day, model, counter, value) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (tenant, day, model, counter) DO UPDATE SET value = value + excluded.value"
)


class SqliteBook(UsageBook):
    def __init__(self, path: str | Path, *, retention_days: int = 400) -> None:
        """``path``: the database file (made with its directory), or ``:memory:``."""
        self.retention_days = retention_days
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
            self.path = str(Path(self.path).expanduser())
        self._db: sqlite3.Connection | None = None
        # A thread lock, not an asyncio one: the work runs in worker threads, and a book may
        # serve more than one event loop (a test's setup, then the server's).
        self._lock = threading.Lock()
        self._written = 0

    def _connect(self) -> sqlite3.Connection:
        if self._db is None:
            db = sqlite3.connect(self.path, timeout=5.0, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at each checkpoint
            for statement in SCHEMA:
                db.execute(statement)
            db.commit()
            self._db = db
        return self._db

    async def _run(self, work):
        def locked():
            with self._lock:
                return work()

        try:
            return await asyncio.to_thread(locked)
        except sqlite3.Error as exc:
            raise BookError(f"sqlite {self.path}: {exc}") from exc

    async def write(self, batch_id: str, entries: Sequence[UsageEntry]) -> bool:
        def work() -> bool:
            db = self._connect()
            with db:  # one transaction: the batch's id and its counts, or neither
                claimed = db.execute(
                    "INSERT INTO forge_usage_batches (batch_id, written_at) VALUES (?, ?) "
                    "ON CONFLICT (batch_id) DO NOTHING",
                    (batch_id, time.time()),
                ).rowcount
                if not claimed:
                    return False
                db.executemany(_UPSERT, [tuple(e) for e in entries])
            self._written += 1
            if self._written % PRUNE_EVERY == 0:
                self._prune(db)
            return True

        return await self._run(work)

    async def prune(self) -> None:
        await self._run(lambda: self._prune(self._connect()))

    def _prune(self, db: sqlite3.Connection) -> None:
        with db:
            db.execute(
                "DELETE FROM forge_usage_batches WHERE written_at < ?",
                (time.time() - BATCH_MEMORY_S,),
            )
            db.execute(
                "DELETE FROM forge_usage WHERE day < ?", (oldest_kept_day(self.retention_days),)
            )

    async def read(self, tenants: Sequence[str], first_day: str, last_day: str) -> list[UsageEntry]:
        if not tenants:
            return []

        def work() -> list[UsageEntry]:
            marks = ",".join("?" * len(tenants))
            rows = self._connect().execute(
                "SELECT tenant, day, model, counter, value FROM forge_usage "
                f"WHERE tenant IN ({marks}) AND day >= ? AND day <= ?",
                (*tenants, first_day, last_day),
            )
            return [UsageEntry(*row) for row in rows]

        return await self._run(work)

    async def close(self) -> None:
        def work() -> None:
            if self._db is not None:
                self._db.close()
                self._db = None

        await self._run(work)
