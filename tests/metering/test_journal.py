"""The usage journal: what a gateway replica had queued for the ledger outlives the replica.

A replica is killed for real here (a child process, SIGKILL) where the question is what the
kernel leaves behind; elsewhere a replica's death is its lock file closed, which is all the
kernel does for a dead process's journal."""

from __future__ import annotations

import datetime as dt
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from serve_app.config.models import MeteringConfig
from serve_app.metering import journal as journal_module
from serve_app.metering.book import BookError
from serve_app.metering.journal import JournalError, UsageJournal
from serve_app.metering.ledger import UsageLedger, UsageRecord, journal_directory, totals

ROOT = Path(__file__).resolve().parents[2]
TODAY = dt.datetime.now(dt.UTC).date()
DAY = TODAY.strftime("%Y-%m-%d")


def record(tenant: str, prompt: int, completion: int, model: str = "m") -> UsageRecord:
    counts = {"requests": 1, "prompt_tokens": prompt, "completion_tokens": completion}
    return UsageRecord(tenant, model, DAY, counts)


async def report(book) -> dict[str, int]:
    return totals(await UsageLedger(book).read(["a", "b"], TODAY, TODAY))


class DownBook:
    """A database that takes no write: everything stays queued."""

    async def write(self, batch_id, entries) -> bool:
        raise BookError("connection refused")

    async def close(self) -> None:
        pass


def full_disk():
    """A file every write to which fails as on a full disk (ENOSPC)."""
    return open("/dev/full", "ab", buffering=0)


def died(ledger: UsageLedger) -> None:
    """What the kernel does for a killed process's journal: its lock is released."""
    assert ledger.journal is not None
    ledger.journal._lock.close()
    ledger.journal._log.close()


# A replica in a process of its own: a batch sealed and unconfirmed (its database is down),
# more queued after it, then it waits to be killed.
KILLED_REPLICA = textwrap.dedent(
    """
    import asyncio, datetime as dt, sys
    from serve_app.metering.book import BookError
    from serve_app.metering.journal import UsageJournal
    from serve_app.metering.ledger import UsageLedger, UsageRecord

    class DownBook:
        async def write(self, batch_id, entries):
            raise BookError("connection refused")

    async def main():
        day = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
        ledger = UsageLedger(DownBook(), flush_s=60, journal=UsageJournal(sys.argv[1]))
        for i in range(3):
            ledger.add(UsageRecord("a", "m", day, {"requests": 1, "prompt_tokens": 10 + i}))
        await ledger.flush()  # sealed, refused: unconfirmed
        for i in range(2):
            ledger.add(UsageRecord("b", "m", day, {"requests": 1, "completion_tokens": 7}))
        print("queued", ledger.queued, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def killed_replica(directory: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_REPLICA, str(directory)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().startswith("queued")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)


async def test_a_killed_replicas_queued_usage_is_written_by_the_next(book, tmp_path):
    directory = tmp_path / "journal"
    killed_replica(directory)

    successor = UsageLedger(book, journal=UsageJournal(directory))
    assert await successor.adopt() == 2  # the unconfirmed batch and the unsealed rest
    counts = await report(book)
    assert counts["requests"] == 5
    assert counts["prompt_tokens"] == 10 + 11 + 12
    assert counts["completion_tokens"] == 14
    assert successor.queued == 0
    assert await successor.adopt() == 0  # written once, and gone
    left = {p.name for p in directory.iterdir()}
    assert left == {f"{successor.journal.owner}.lock", f"{successor.journal.owner}.log"}


async def test_a_batch_applied_before_its_replica_died_is_not_applied_again(book, tmp_path):
    first = UsageLedger(book, journal=UsageJournal(tmp_path))
    first.add(record("a", 100, 20))
    first.journal.confirmed = lambda batch_id: None  # killed between the commit and the delete
    await first.flush()
    died(first)

    successor = UsageLedger(book, journal=UsageJournal(tmp_path))
    assert await successor.adopt() == 1
    counts = await report(book)
    assert (counts["requests"], counts["prompt_tokens"], counts["completion_tokens"]) == (
        1,
        100,
        20,
    )
    assert not list(tmp_path.glob("*.batch"))


async def test_a_live_replicas_journal_is_left_alone(tmp_path):
    alive = UsageLedger(DownBook(), journal=UsageJournal(tmp_path))
    alive.add(record("a", 5, 5))
    other = UsageLedger(DownBook(), journal=UsageJournal(tmp_path))
    assert await other.adopt() == 0
    assert alive.queued == 3
    assert (tmp_path / f"{alive.journal.owner}.log").stat().st_size > 0


async def test_a_long_outage_keeps_the_journal_as_small_as_its_counts(book, tmp_path, monkeypatch):
    monkeypatch.setattr(journal_module, "COMPACT_AT_BYTES", 4096)
    ledger = UsageLedger(DownBook(), journal=UsageJournal(tmp_path))
    for i in range(2000):
        ledger.add(record("ab"[i % 2], 3, 2))
        if i % 100 == 99:
            await ledger.flush()  # refused: the pending part is compacted past the bound
    unsealed = tmp_path / f"{ledger.journal.owner}.log"
    assert unsealed.stat().st_size < 4 * 4096  # 2,000 appends would be ~100 KB
    died(ledger)

    successor = UsageLedger(book, journal=UsageJournal(tmp_path))
    await successor.adopt()
    counts = await report(book)
    assert (counts["requests"], counts["prompt_tokens"], counts["completion_tokens"]) == (
        2000,
        6000,
        4000,
    )


async def test_a_torn_last_line_is_skipped_and_the_rest_is_written(book, tmp_path):
    ledger = UsageLedger(DownBook(), journal=UsageJournal(tmp_path))
    ledger.add(record("a", 4, 1))
    ledger.add(record("b", 6, 1))
    with (tmp_path / f"{ledger.journal.owner}.log").open("ab") as f:
        f.write(b'["a","2026-12-0')  # a full disk cut the last append short
    died(ledger)

    await UsageLedger(book, journal=UsageJournal(tmp_path)).adopt()
    counts = await report(book)
    assert (counts["requests"], counts["prompt_tokens"]) == (2, 10)


async def test_a_clean_close_leaves_nothing_to_adopt(book, tmp_path):
    ledger = UsageLedger(book, journal=UsageJournal(tmp_path / "journal"))
    ledger.add(record("a", 1, 1))
    await ledger.aclose()
    assert list((tmp_path / "journal").iterdir()) == []


async def test_a_close_with_the_database_down_leaves_the_usage_for_the_next(book, tmp_path):
    ledger = UsageLedger(DownBook(), journal=UsageJournal(tmp_path))
    ledger.add(record("a", 8, 3))
    await ledger.aclose(timeout_s=0.1)

    assert await UsageLedger(book, journal=UsageJournal(tmp_path)).adopt() == 1
    assert (await report(book))["prompt_tokens"] == 8


async def test_a_journal_on_a_full_disk_is_counted_and_the_usage_still_lands(book, tmp_path):
    failures: list[Exception] = []
    ledger = UsageLedger(book, on_error=failures.append, journal=UsageJournal(tmp_path))
    ledger.journal._log = full_disk()
    ledger.add(record("a", 9, 9))
    await ledger.flush()
    assert [type(f) for f in failures] == [JournalError]
    assert (await report(book))["prompt_tokens"] == 9


def test_each_ledger_has_a_journal_directory_of_its_own(monkeypatch, tmp_path):
    sqlite = MeteringConfig(sqlite_path=str(tmp_path / "usage.sqlite3"))
    assert journal_directory(sqlite) == tmp_path / "usage.sqlite3.journal"
    explicit = MeteringConfig(journal_dir=str(tmp_path / "j"))
    assert journal_directory(explicit) == tmp_path / "j"

    # Made-up passwords, for the test to see that none names the directory.
    a_url = "postgresql://forge:s3cret@db-a:5432/usage"  # pragma: allowlist secret
    b_url = "postgresql://forge:other@db-a:5432/usage"  # pragma: allowlist secret
    c_url = "postgresql://forge:s3cret@db-c:5432/usage"  # pragma: allowlist secret
    monkeypatch.setenv("FORGE_TEST_LEDGER_A", a_url)
    monkeypatch.setenv("FORGE_TEST_LEDGER_B", b_url)
    monkeypatch.setenv("FORGE_TEST_LEDGER_C", c_url)
    a, b, c = (
        journal_directory(MeteringConfig(database_url_env=f"FORGE_TEST_LEDGER_{x}")) for x in "ABC"
    )
    assert a == b != c  # by the database's address; a rotated password is the same ledger
    assert "s3cret" not in str(a)


def test_with_the_journal_off_there_is_none(tmp_path):
    from serve_app.metering.ledger import build_journal

    assert build_journal(MeteringConfig(journal=False, journal_dir=str(tmp_path))) is None
    assert list(tmp_path.iterdir()) == []


async def test_a_dead_journal_is_adopted_by_one_replica_at_a_time(book, tmp_path):
    dead = UsageLedger(DownBook(), journal=UsageJournal(tmp_path))
    dead.add(record("a", 30, 3))
    died(dead)
    first, second = (UsageLedger(book, journal=UsageJournal(tmp_path)) for _ in range(2))
    taking = list(first.journal.orphans())  # the first holds its lock while it writes
    assert len(taking) == 1
    assert await second.adopt() == 0
    taking[0].lock.close()  # and dies in turn, before writing a byte

    assert await second.adopt() == 1
    assert await first.adopt() == 0
    assert (await report(book))["prompt_tokens"] == 30


async def test_a_journal_whose_directory_is_gone_never_fails_a_request(book, tmp_path):
    """Appends, seals and reopening all fail: each is counted, and the usage lands all the
    same (in memory only, as without a journal)."""
    import shutil

    failures: list[Exception] = []
    directory = tmp_path / "journal"
    ledger = UsageLedger(book, on_error=failures.append, journal=UsageJournal(directory))
    ledger.add(record("a", 1, 1))
    shutil.rmtree(directory)
    await ledger.flush()  # the seal's rename fails, and so does the new file
    ledger.add(record("a", 2, 2))  # an append to a file that is no more
    await ledger.flush()
    await ledger.aclose()
    assert failures and all(isinstance(f, JournalError) for f in failures)
    assert (await report(book))["prompt_tokens"] == 3
