"""The usage book's contract, on SQLite and PostgreSQL alike: counts add up, a batch applies
once however often it is sent, reads select by tenant and day, and what was written survives
the process (a new connection to the same database reads it)."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid

from serve_app.metering.book import UsageBook, UsageEntry
from serve_app.metering.sqlite import SqliteBook


def entry(tenant="acme", day="2026-12-01", model="m", counter="requests", value=1) -> UsageEntry:
    return UsageEntry(tenant, day, model, counter, value)


def totals(entries) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for e in entries:
        key = (e.tenant, e.day, e.model, e.counter)
        out[key] = out.get(key, 0) + e.value
    return out


async def test_batches_add_up_per_tenant_day_model_and_counter(book: UsageBook) -> None:
    assert await book.write("b1", [entry(value=2), entry(counter="prompt_tokens", value=40)])
    assert await book.write("b2", [entry(value=3), entry(model="other", value=1)])
    rows = totals(await book.read(["acme"], "2026-12-01", "2026-12-01"))
    assert rows == {
        ("acme", "2026-12-01", "m", "requests"): 5,
        ("acme", "2026-12-01", "m", "prompt_tokens"): 40,
        ("acme", "2026-12-01", "other", "requests"): 1,
    }


async def test_a_batch_sent_again_is_applied_once(book: UsageBook) -> None:
    """A retry after a lost reply (the commit landed, its acknowledgement did not) carries the
    same id: the database refuses the second, and the counts stay as they were."""
    batch = [entry(value=7)]
    assert await book.write("once", batch) is True
    assert await book.write("once", batch) is False
    assert await book.write("once", [entry(value=100)]) is False
    (row,) = await book.read(["acme"], "2026-12-01", "2026-12-01")
    assert row.value == 7


async def test_reads_select_tenants_and_an_inclusive_day_range(book: UsageBook) -> None:
    await book.write(
        "b",
        [
            entry(day="2026-11-30"),
            entry(day="2026-12-01"),
            entry(day="2026-12-02"),
            entry(tenant="other", day="2026-12-01"),
        ],
    )
    days = sorted(e.day for e in await book.read(["acme"], "2026-12-01", "2026-12-02"))
    assert days == ["2026-12-01", "2026-12-02"]
    assert await book.read([], "2026-12-01", "2026-12-02") == []
    assert {e.tenant for e in await book.read(["acme", "other"], "2026-12-01", "2026-12-01")} == {
        "acme",
        "other",
    }


async def test_concurrent_writers_lose_no_increment(book: UsageBook) -> None:
    """Two gateway replicas writing the same rows at once (here: many batches in parallel)."""
    await asyncio.gather(
        *(
            book.write(uuid.uuid4().hex, [entry(value=1), entry(tenant="b", value=2)])
            for _ in range(40)
        )
    )
    rows = totals(await book.read(["acme", "b"], "2026-12-01", "2026-12-01"))
    assert rows[("acme", "2026-12-01", "m", "requests")] == 40
    assert rows[("b", "2026-12-01", "m", "requests")] == 80


async def test_big_counts_keep_their_precision(book: UsageBook) -> None:
    big = 2**53 + 1  # beyond a double's integers: a float column would round it
    await book.write("b", [entry(counter="prompt_tokens", value=big)])
    await book.write("c", [entry(counter="prompt_tokens", value=1)])
    (row,) = await book.read(["acme"], "2026-12-01", "2026-12-01")
    assert row.value == big + 1


async def test_what_was_written_survives_the_connection(tmp_path) -> None:
    """A gateway replica that stops (or dies) and a new one reading the same file."""
    path = tmp_path / "books" / "usage.sqlite3"
    first = SqliteBook(path)
    await first.write("b", [entry(value=5)])
    await first.close()
    second = SqliteBook(path)
    (row,) = await second.read(["acme"], "2026-12-01", "2026-12-01")
    assert row.value == 5
    assert await second.write("b", [entry(value=5)]) is False  # its id is remembered too
    await second.close()


async def test_days_past_the_retention_are_pruned(book: UsageBook) -> None:
    book.retention_days = 30
    today = dt.datetime.now(dt.UTC).date()
    old, kept = (today - dt.timedelta(days=d) for d in (31, 29))
    await book.write("b", [entry(day=str(old)), entry(day=str(kept))])
    await book.prune()
    days = [e.day for e in await book.read(["acme"], str(old), str(today))]
    assert days == [str(kept)]
