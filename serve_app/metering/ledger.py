"""Usage per tenant, model and day: what a platform team bills from, kept in the store.

One request is one ``UsageRecord`` when its response ends (however it ends). Its counts are
added to the tenant's hash for the day in one atomic store call, and the same record increments
the Prometheus counters, so the report and the dashboards cannot disagree. Tokens are the
backends' own ``usage``: the engines' counts (an abandoned stream's too, collected from its
replica), the fallback's, or the cached answer's for a hit. Only where no backend said (a
fallback stream the client left, a replica that died mid-stream) is the gateway's estimate
used, and such requests are counted as ``estimated_requests``.

Key layout: ``usage:{tenant}:{YYYY-MM-DD}`` (UTC), a hash whose fields are ``{counter}|{model}``;
tenants come from the config, so a report reads known keys and never scans the keyspace.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from serve_app.protocol import count_prompt_tokens
from serve_app.store import Store, StoreError

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
_SEP = "|"
DAY_FORMAT = "%Y-%m-%d"
MAX_REPORT_DAYS = 400


def error_class(status: int) -> str | None:
    """The class a final status counts under, or None for a success."""
    if status < 400:
        return None
    if status == 429:
        return "rate_limited"
    if status == 499:
        return "disconnected"  # the client left first
    if status == 599:
        return "truncated"  # failed after the first byte
    if status >= 500:
        return "upstream"
    return "invalid"


def charged_tokens(ctx) -> tuple[int, int, bool]:
    """(prompt, completion, exact) a request is charged: the backend's (or the cached
    answer's) own ``usage``; without one, the prompt estimate plus the frames relayed, when
    anything was; nothing for a request refused or failed before its first byte."""
    usage = ctx.usage
    if usage:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens") or 0
        if _count(prompt) is not None and _count(completion) is not None:
            return prompt, completion, True
        # an upstream's malformed usage: our own estimate instead
    if ctx.first_byte_at is None:
        return 0, 0, True
    if ctx.prompt_estimate is None:
        ctx.prompt_estimate = count_prompt_tokens(ctx.body, ctx.route)
    return ctx.prompt_estimate, ctx.frames_sent, False


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def day_of(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp, dt.UTC).strftime(DAY_FORMAT)


def usage_key(tenant: str, day: str) -> str:
    # The tenant in a hash tag: a Redis Cluster keeps a tenant's days on one slot.
    return f"usage:{{{tenant}}}:{day}"


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One request's contribution to its tenant's day."""

    tenant: str
    model: str
    day: str
    counts: Mapping[str, int]

    def fields(self) -> dict[str, int]:
        return {f"{name}{_SEP}{self.model}": n for name, n in self.counts.items() if n}


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
    """Writes records to the store (batched, retried, each batch applied exactly once) and
    reads reports back.

    Records are merged per tenant and day in memory and written every ``flush_s`` (one store
    call per tenant-day, not per request). A write that fails stays queued, with its id, and is
    retried until the store takes it: a timeout that was in fact applied is not applied again
    (``Store.add_counts(once=...)``), and nothing is lost to a store that is slow or down for a
    while, only delayed. Memory stays bounded by tenants x days, whatever the outage's length.
    Only a gateway that dies with writes still queued loses them (at most ``flush_s`` of usage
    while the store is up).
    """

    def __init__(
        self,
        store: Store,
        retention_days: int,
        *,
        flush_s: float = 1.0,
        on_error: Callable[[StoreError], None] | None = None,
    ) -> None:
        self.store = store
        self.ttl_s = retention_days * 86_400.0
        self.flush_s = flush_s
        self.on_error = on_error
        self._pending: dict[str, dict[str, int]] = {}  # key → field → count, not yet sent
        self._unconfirmed: dict[str, tuple[str, dict[str, int]]] = {}  # key → (id, counts)
        self._flusher: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    def add(self, record: UsageRecord) -> None:
        """Queue a record (no store call here); the flusher writes it within ``flush_s``."""
        fields = record.fields()
        if not fields:
            return
        pending = self._pending.setdefault(usage_key(record.tenant, record.day), {})
        for name, value in fields.items():
            pending[name] = pending.get(name, 0) + value
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._flush_soon())

    @property
    def queued(self) -> int:
        """Tenant-days with counts not yet confirmed by the store."""
        return len(self._pending.keys() | self._unconfirmed.keys())

    async def _flush_soon(self) -> None:
        while self._pending or self._unconfirmed:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        """Send what is queued; a write that fails stays queued for the next flush."""
        async with self._lock:
            # A write keeps its id and counts until the store confirms it (a retry must be the
            # same write); counts of a key whose write is unconfirmed wait for the next one.
            for key in list(self._pending):
                if key not in self._unconfirmed:
                    self._unconfirmed[key] = (uuid.uuid4().hex, self._pending.pop(key))
            for key, (once, counts) in list(self._unconfirmed.items()):
                try:
                    await self.store.add_counts(key, counts, self.ttl_s, once=once)
                except StoreError as exc:
                    if self.on_error is not None:
                        self.on_error(exc)
                    return  # the store is struggling: the rest waits for the next flush
                del self._unconfirmed[key]

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Write what is queued before the gateway goes (retrying for up to ``timeout_s``)."""
        if self._flusher is not None:
            self._flusher.cancel()
        deadline = asyncio.get_running_loop().time() + timeout_s
        loop = asyncio.get_running_loop()
        while (self._pending or self._unconfirmed) and loop.time() < deadline:
            await self.flush()
            if self._pending or self._unconfirmed:
                await asyncio.sleep(min(0.2, self.flush_s))

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
        names = list(tenants)
        keys = [usage_key(t, d) for t in names for d in days]
        hashes = await self.store.read_counts(keys) if keys else []
        rows: dict[tuple[str, str, str | None], UsageRow] = {}
        for i, counts in enumerate(hashes):
            tenant, day = names[i // len(days)], days[i % len(days)]
            for name_model, value in counts.items():
                name, _, row_model = name_model.partition(_SEP)
                if model is not None and row_model != model:
                    continue
                key = (tenant, row_model, day if by_day else None)
                row = rows.get(key)
                if row is None:
                    row = rows[key] = UsageRow(tenant, row_model, key[2])
                row.counts[name] = row.counts.get(name, 0) + value
        return [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1], k[2] or ""))]


def totals(rows: Sequence[UsageRow]) -> dict[str, int]:
    """Every counter summed over rows (a report's footer, a test's ground truth)."""
    out: dict[str, int] = {}
    for row in rows:
        for name, value in row.counts.items():
            out[name] = out.get(name, 0) + value
    return out
