"""The ``book`` fixture: every usage-book contract test runs against SQLite (a file) and a real
PostgreSQL (127.0.0.1:5432, this machine's; ``FORGE_TEST_POSTGRES_URL`` to point elsewhere),
each test in a schema of its own. Without a PostgreSQL answering, its half skips, saying so."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import pytest

from serve_app.metering.book import UsageBook
from serve_app.metering.postgres import PostgresBook
from serve_app.metering.sqlite import SqliteBook

POSTGRES_URL = os.environ.get(
    "FORGE_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)


async def postgres_schema() -> str | None:
    """A fresh schema's URL, or None where no PostgreSQL answers."""
    import asyncpg

    schema = f"forge_test_{uuid.uuid4().hex[:12]}"
    try:
        db = await asyncpg.connect(POSTGRES_URL, timeout=3)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return None
    try:
        await db.execute(f"CREATE SCHEMA {schema}")
    finally:
        await db.close()
    separator = "&" if "?" in POSTGRES_URL else "?"
    return f"{POSTGRES_URL}{separator}search_path={schema}"


async def drop_schema(url: str) -> None:
    import asyncpg

    schema = url.rsplit("search_path=", 1)[1]
    db = await asyncpg.connect(POSTGRES_URL, timeout=3)
    try:
        await db.execute(f"DROP SCHEMA {schema} CASCADE")
    finally:
        await db.close()


@pytest.fixture(params=["sqlite", "postgres"])
async def book(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[UsageBook]:
    if request.param == "sqlite":
        book = SqliteBook(tmp_path / "usage.sqlite3")
        yield book
        await book.close()
        return
    url = await postgres_schema()
    if url is None:
        pytest.skip(f"no PostgreSQL answers at {POSTGRES_URL}")
    book = PostgresBook(url)
    try:
        yield book
    finally:
        await book.close()
        await drop_schema(url)
