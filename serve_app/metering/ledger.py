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
import os
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from serve_app.config.models import ConfigError, MeteringConfig
from serve_app.metering.book import BookError, UsageBook, UsageEntry
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
    whatever the outage's length. What a gateway replica that dies loses: what it had not
    written yet, at most ``flush_s`` of its usage while the database is up (its responses had
    ended; the client saw them complete) and everything queued while it was down.
    """

    def __init__(
        self,
        book: UsageBook,
        *,
        flush_s: float = 1.0,
        on_error: Callable[[BookError], None] | None = None,
    ) -> None:
        self.book = book
        self.flush_s = flush_s
        self.on_error = on_error
        self._pending: dict[tuple[str, str, str, str], int] = {}  # not yet in a batch
        self._unconfirmed: tuple[str, list[UsageEntry]] | None = None  # (id, entries) sent
        self._flusher: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    def add(self, record: UsageRecord) -> None:
        """Queue a record (no database call here); the flusher writes it within ``flush_s``."""
        for name, value in record.counts.items():
            if value:
                key = (record.tenant, record.day, record.model, name)
                self._pending[key] = self._pending.get(key, 0) + value
        if self._pending and (self._flusher is None or self._flusher.done()):
            self._flusher = asyncio.get_running_loop().create_task(self._flush_soon())

    @property
    def queued(self) -> int:
        """Rows with counts not yet confirmed by the database."""
        return len(self._pending) + (len(self._unconfirmed[1]) if self._unconfirmed else 0)

    async def _flush_soon(self) -> None:
        while self._pending or self._unconfirmed:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        """Send what is queued; a batch that fails stays queued, with its id, for the next."""
        async with self._lock:
            if self._unconfirmed is None and self._pending:
                entries = [UsageEntry(*key, value) for key, value in self._pending.items()]
                self._pending = {}
                self._unconfirmed = (uuid.uuid4().hex, entries)
            if self._unconfirmed is None:
                return
            batch_id, entries = self._unconfirmed
            try:
                await self.book.write(batch_id, entries)
            except BookError as exc:
                if self.on_error is not None:
                    self.on_error(exc)
                return  # the same batch, the same id, next time
            self._unconfirmed = None

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Write what is queued before the gateway goes (retrying for up to ``timeout_s``),
        then close the book."""
        if self._flusher is not None:
            self._flusher.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (self._pending or self._unconfirmed) and loop.time() < deadline:
            await self.flush()
            if self._pending or self._unconfirmed:
                await asyncio.sleep(min(0.2, self.flush_s))
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
        return PostgresBook(url, retention_days=config.retention_days)
    path = config.sqlite_path or DEFAULT_SQLITE_PATH
    return SqliteBook(path, retention_days=config.retention_days)


def totals(rows: Sequence[UsageRow]) -> dict[str, int]:
    """Every counter summed over rows (a report's footer, a test's ground truth)."""
    out: dict[str, int] = {}
    for row in rows:
        for name, value in row.counts.items():
            out[name] = out.get(name, 0) + value
    return out
