"""Usage per tenant, model and day: what a platform team bills from, kept in a database.

One request is one ``UsageRecord`` when its response ends (however it ends). The gateway
replica merges records in memory and writes them in batches, off the request path, to the
durable ledger (``metering/book.py``: PostgreSQL on a cluster, SQLite on a laptop), each batch
applied exactly once; the same record increments the Prometheus counters, so the report and the
dashboards cannot disagree. Tokens are the
backends' own ``usage``: the engines' counts (an abandoned stream's too, collected from its
replica), the fallback's, or the cached answer's for a hit. Only where no backend said (a
fallback request the client left, streamed or not; a replica that died mid-stream or did not
say in time what an abandoned request cost) is the gateway's estimate used, and such requests
are counted as ``estimated_requests``.

Rows: (tenant, day (UTC), model, counter) → count; tenants come from the config, so a report
reads known tenants' rows only.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from serve_app.config.models import ConfigError, MeteringConfig
from serve_app.metering.book import BookError, UsageBook, UsageEntry
from serve_app.metering.journal import JournalError, Orphan, UsageJournal
from serve_app.metering.postgres import PostgresBook
from serve_app.metering.sqlite import SqliteBook

# Counters of a day, per model. ``prompt_tokens``/``completion_tokens`` are what the backends
# processed; a cache hit's tokens are ``cached_tokens`` (nothing was generated for them).
COUNTERS = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_requests",
    "cached_tokens",
    "fallback_requests",
    "estimated_requests",
)
# Errors by class, each a counter ``errors_{class}`` (see ``error_class``).
ERROR_CLASSES = ("invalid", "rate_limited", "upstream", "disconnected", "truncated")
DAY_FORMAT = "%Y-%m-%d"
MAX_REPORT_DAYS = 400
# The laptop's ledger, where the config names none: durable across runs of `serve run`.
DEFAULT_SQLITE_PATH = "~/.local/share/forge/usage.sqlite3"
logger = logging.getLogger("ray.serve")
ADOPT_EVERY_S = 10.0  # how often a replica looks for dead replicas' journals


def error_class(status: int) -> str | None:
    """The class a final status counts under, or None for a success."""
    if status < 400:
        return None
    if status == 429:
        return "rate_limited"
    if status == 499:
        return "disconnected"  # the client left first, or its own deadline ran out
    if status == 599:
        return "truncated"  # failed after the first byte
    if status >= 500:
        return "upstream"
    return "invalid"


def charged_tokens(ctx) -> tuple[int, int, bool]:
    """(prompt, completion, exact) a request is charged: the backend's (or the cached
    answer's) own ``usage``; without one, the prompt estimate plus the frames relayed, when
    anything was or a backend was answering uncounted when the client left
    (``RequestContext.left_uncounted``); nothing for a request refused or failed before its
    first byte."""
    usage = ctx.usage
    if usage:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens") or 0
        if _count(prompt) is not None and _count(completion) is not None:
            return prompt, completion, True
        # an upstream's malformed usage: our own estimate instead
    if ctx.first_byte_at is None and not ctx.left_uncounted:
        return 0, 0, True
    return ctx.counted_prompt(), ctx.frames_sent, False


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def day_of(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).strftime(DAY_FORMAT)


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One request's contribution to its tenant's day."""

    tenant: str
    model: str
    day: str
    counts: Mapping[str, int]


@dataclass(slots=True)
class UsageRow:
    """A tenant's usage of one model on one day (or summed over a range: ``day`` is None)."""

    tenant: str
    model: str
    day: str | None
    counts: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)

    def as_dict(self) -> dict:
        errors = {c: self.counts.get(f"errors_{c}", 0) for c in ERROR_CLASSES}
        return {
            "tenant": self.tenant,
            "model": self.model,
            "date": self.day,
            **{name: self.counts.get(name, 0) for name in COUNTERS},
            "errors": errors,
        }


def date_range(start: dt.date, end: dt.date) -> list[str]:
    """Every day from ``start`` to ``end`` inclusive; a ``ValueError`` for a reversed or too
    long range (a report reads one key per tenant and day)."""
    if end < start:
        raise ValueError(f"end {end} is before start {start}")
    days = (end - start).days + 1
    if days > MAX_REPORT_DAYS:
        raise ValueError(f"a report covers at most {MAX_REPORT_DAYS} days, not {days}")
    return [(start + dt.timedelta(days=i)).strftime(DAY_FORMAT) for i in range(days)]


class UsageLedger:
    """Writes records to the book (batched, retried, each batch applied exactly once) and reads
    reports back.

    Records are merged per (tenant, day, model, counter) in memory and written every
    ``flush_s`` as one batch, one transaction. A batch that fails stays queued with its id and
    is retried until the database takes it: one whose commit landed but whose answer was lost
    is not applied again (the database refuses its id). Nothing is lost to a database that is
    slow or down for a while, only delayed, and memory stays bounded by tenants x days x models
    whatever the outage's length. With a ``journal`` (``metering/journal.py``), what is queued
    is in a file as well, and a replica that dies loses none of it: another replica sharing
    the journal's directory adopts it. Without one, a replica that dies loses what it had not
    written yet: at most ``flush_s`` of its usage while the database is up, and everything
    queued while it was down.
    """

    def __init__(
        self,
        book: UsageBook,
        *,
        flush_s: float = 1.0,
        on_error: Callable[[Exception], None] | None = None,
        journal: UsageJournal | None = None,
    ) -> None:
        self.book = book
        self.flush_s = flush_s
        self.on_error = on_error  # a BookError (retried) or a JournalError (memory only)
        self.journal = journal
        self._pending: dict[tuple[str, str, str, str], int] = {}  # not yet in a batch
        self._unconfirmed: tuple[str, list[UsageEntry]] | None = None  # (id, entries) sent
        self._adopted: list[Orphan] = []  # dead replicas' journals, being written
        self._flusher: asyncio.Task | None = None
        self._adopter: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    def add(self, record: UsageRecord) -> None:
        """Queue a record (no database call here; one file append with a journal); the flusher
        writes it within ``flush_s``."""
        counts = {name: value for name, value in record.counts.items() if value}
        if not counts:
            return
        if self.journal is not None:
            try:
                self.journal.append(record.tenant, record.day, record.model, counts)
            except JournalError as exc:
                self._failed(exc)
        for name, value in counts.items():
            key = (record.tenant, record.day, record.model, name)
            self._pending[key] = self._pending.get(key, 0) + value
        self._flush_later()

    def _flush_later(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_soon())

    @property
    def queued(self) -> int:
        """Rows with counts not yet confirmed by the database (dead replicas' adopted too)."""
        adopted = sum(len(e) for o in self._adopted for e in o.batches.values())
        unconfirmed = len(self._unconfirmed[1]) if self._unconfirmed else 0
        return len(self._pending) + unconfirmed + adopted

    async def _flush_soon(self) -> None:
        while self._pending or self._unconfirmed or self._adopted:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        """Send what is queued; a batch that fails stays queued, with its id, for the next."""
        async with self._lock:
            if self._unconfirmed is None and self._pending:
                entries = [UsageEntry(*key, value) for key, value in self._pending.items()]
                self._pending = {}
                batch_id = uuid.uuid4().hex
                self._unconfirmed = (batch_id, entries)
                if self.journal is not None:
                    try:
                        self.journal.seal(batch_id)
                    except JournalError as exc:
                        self._failed(exc)
            if self._unconfirmed is not None:
                batch_id, entries = self._unconfirmed
                if not await self._written(batch_id, entries):
                    self._compact()
                    return  # the same batch, the same id, next time
                self._unconfirmed = None
                if self.journal is not None:
                    self.journal.confirmed(batch_id)
            await self._write_adopted()

    async def _written(self, batch_id: str, entries: list[UsageEntry]) -> bool:
        try:
            await self.book.write(batch_id, entries)
        except BookError as exc:
            self._failed(exc)
            return False
        return True

    def _compact(self) -> None:
        """The database is down: keep the journal's unsealed file as small as what it holds."""
        if self.journal is not None and self.journal.should_compact():
            try:
                self.journal.compact(self._pending)
            except JournalError as exc:
                self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        if self.on_error is not None:
            self.on_error(exc)

    # -- dead replicas' journals -------------------------------------------------------------

    def start(self) -> None:
        """Adopt dead replicas' journals now and every ``ADOPT_EVERY_S`` (a replica killed
        while this one runs is adopted by it, or by its own replacement)."""
        if self.journal is not None and self._adopter is None:
            self._adopter = asyncio.get_running_loop().create_task(self._adopt_forever())

    async def _adopt_forever(self) -> None:
        while True:
            try:
                await self.adopt()
            except Exception:  # the next round tries again; this one is said
                logger.exception("adopting dead replicas' usage journals failed")
            await asyncio.sleep(ADOPT_EVERY_S)

    async def adopt(self) -> int:
        """Take the journals whose replicas are gone and write them; the batches taken."""
        if self.journal is None:
            return 0
        async with self._lock:
            found = []
            try:
                for orphan in self.journal.orphans():
                    if orphan.batches:
                        found.append(orphan)
                    else:
                        orphan.release()  # a replica that ended with nothing queued
            except OSError as exc:
                self._failed(JournalError(f"usage journal {self.journal.directory}: {exc}"))
            for orphan in found:
                # A warning: a replica died with usage unwritten (and Serve holds the replica
                # logger at WARNING through the lifespan's start, when a replacement adopts).
                logger.warning(
                    "adopting the usage journal of a gateway replica that is gone (%s): %d "
                    "batch(es)",
                    orphan.owner,
                    len(orphan.batches),
                )
            self._adopted += found
            taken = sum(len(o.batches) for o in found)
            await self._write_adopted()
        if self._adopted:
            self._flush_later()
        return taken

    async def _write_adopted(self) -> None:
        for orphan in list(self._adopted):
            for batch_id, entries in list(orphan.batches.items()):
                if not await self._written(batch_id, entries):
                    return
                orphan.written(batch_id)
            orphan.release()
            self._adopted.remove(orphan)

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Write what is queued before the gateway goes (retrying for up to ``timeout_s``),
        then close the book."""
        for task in (self._flusher, self._adopter):
            if task is not None:
                task.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.queued and loop.time() < deadline:
            await self.flush()
            if self.queued:
                await asyncio.sleep(min(0.2, self.flush_s))
        for orphan in self._adopted:  # not written: the next replica adopts it again
            orphan.lock.close()
        self._adopted = []
        if self.journal is not None:
            self.journal.close()
        await self.book.close()

    async def read(
        self,
        tenants: Iterable[str],
        start: dt.date,
        end: dt.date,
        *,
        model: str | None = None,
        by_day: bool = True,
    ) -> list[UsageRow]:
        """Rows per tenant, model (and day, unless ``by_day`` is False: summed over the range),
        sorted; a model filter keeps that model's rows only."""
        days = date_range(start, end)
        entries = await self.book.read(list(tenants), days[0], days[-1])
        rows: dict[tuple[str, str, str | None], UsageRow] = {}
        for e in entries:
            if model is not None and e.model != model:
                continue
            key = (e.tenant, e.model, e.day if by_day else None)
            row = rows.get(key)
            if row is None:
                row = rows[key] = UsageRow(e.tenant, e.model, key[2])
            row.counts[e.counter] = row.counts.get(e.counter, 0) + e.value
        return [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1], k[2] or ""))]


def build_book(config: MeteringConfig) -> UsageBook:
    """PostgreSQL where ``database_url_env`` names it (an unset variable stops start-up, with
    its name: a laptop's file is never a silent stand-in for the cluster's database), else
    the SQLite file at ``sqlite_path``."""
    if config.database_url_env:
        url = os.environ.get(config.database_url_env)
        if not url:
            raise ConfigError(
                f"metering.database_url_env names {config.database_url_env}, which is unset: "
                "export the PostgreSQL URL there (or drop it for the SQLite file)"
            )
        if urlsplit(url).scheme not in ("postgresql", "postgres"):
            # A malformed URL would fail every write, retried for ever as an outage would be.
            raise ConfigError(
                f"metering.database_url_env names {config.database_url_env}, which does not "
                "hold a PostgreSQL URL (postgresql://user@host:5432/database)"
            )
        return PostgresBook(url, retention_days=config.retention_days)
    path = config.sqlite_path or DEFAULT_SQLITE_PATH
    return SqliteBook(path, retention_days=config.retention_days)


def journal_directory(config: MeteringConfig) -> Path:
    """Where the replicas of a machine keep the usage they have not written (``journal_dir``,
    else one directory per ledger: an adopter writes what it finds to the ledger it came for)."""
    if config.journal_dir:
        return Path(config.journal_dir).expanduser()
    if config.database_url_env:
        url = urlsplit(os.environ.get(config.database_url_env, ""))
        # The database's address, not its password, names the directory.
        where = f"{url.hostname}:{url.port}{url.path}?{url.query}"
        digest = hashlib.sha256(where.encode()).hexdigest()[:16]
        return Path(f"~/.local/share/forge/journal-{digest}").expanduser()
    path = Path(config.sqlite_path or DEFAULT_SQLITE_PATH).expanduser()
    return path.with_name(path.name + ".journal")


def build_journal(config: MeteringConfig) -> UsageJournal | None:
    """The replica's journal, or None (metering keeps usage in memory only) where it is off or
    its directory takes no files: said, and never a reason not to serve."""
    if not config.journal:
        return None
    directory = journal_directory(config)
    try:
        return UsageJournal(directory)
    except OSError as exc:
        logger.warning("no usage journal in %s (%s): usage queued in memory only", directory, exc)
        return None


def totals(rows: Sequence[UsageRow]) -> dict[str, int]:
    """Every counter summed over rows (a report's footer, a test's ground truth)."""
    out: dict[str, int] = {}
    for row in rows:
        for name, value in row.counts.items():
            out[name] = out.get(name, 0) + value
    return out
