"""The durable usage ledger's seam: where usage records are written once and read back.

A platform team bills its tenants from this, so it lives in a database, never beside the cache:
PostgreSQL on a cluster (``metering/postgres.py``), SQLite in a file on a laptop
(``metering/sqlite.py``, no server). Both keep one row per (tenant, day, model, counter) and a
table of the batches they have applied: a batch is written in one transaction that first
claims its id, so a retry of a batch whose commit was acknowledged too late adds nothing (the
database's primary key enforces it, not the gateway's memory). The contract suite,
``tests/metering/test_book_contract.py``, runs against both.
"""

from __future__ import annotations

import datetime as dt
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

# The tables: counts, and the ids of the batches applied (with when, to prune them).
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS forge_usage (
        tenant TEXT NOT NULL,
        day TEXT NOT NULL,
        model TEXT NOT NULL,
        counter TEXT NOT NULL,
        value BIGINT NOT NULL,
        PRIMARY KEY (tenant, day, model, counter)
    )""",
    """CREATE TABLE IF NOT EXISTS forge_usage_batches (
        batch_id TEXT PRIMARY KEY,
        written_at DOUBLE PRECISION NOT NULL
    )""",
)
# A batch id is remembered this long: far longer than a write can stay unconfirmed (a gateway
# retries until it is taken, and a dead gateway's queue is gone with it).
BATCH_MEMORY_S = 7 * 86_400.0
PRUNE_EVERY = 1000  # batches written between two prunings (old batch ids, expired days)


def oldest_kept_day(retention_days: int) -> str:
    """Rows of days before this one are past their retention."""
    today = dt.datetime.now(dt.UTC).date()
    return (today - dt.timedelta(days=retention_days)).strftime("%Y-%m-%d")


class UsageEntry(NamedTuple):
    tenant: str
    day: str  # YYYY-MM-DD, UTC
    model: str
    counter: str
    value: int


class BookError(Exception):
    """The database did not take (or answer) the call: a write is retried, a read fails."""


class UsageBook(ABC):
    @abstractmethod
    async def write(self, batch_id: str, entries: Sequence[UsageEntry]) -> bool:
        """Add every entry's value to its row, in one transaction, unless ``batch_id`` was
        applied already. Returns whether it was applied now. ``BookError`` when the database
        fails: the batch may or may not have been applied, and a retry with the same id is
        always safe."""

    @abstractmethod
    async def read(self, tenants: Sequence[str], first_day: str, last_day: str) -> list[UsageEntry]:
        """Every row of these tenants from ``first_day`` to ``last_day`` inclusive."""

    @abstractmethod
    async def prune(self) -> None:
        """Drop days past the retention and batch ids past ``BATCH_MEMORY_S`` (also done every
        ``PRUNE_EVERY`` batches)."""

    @abstractmethod
    async def close(self) -> None:
        """Release the connection(s)."""
