"""The embedded store: one process's memory, the laptop default when no ``redis_url`` is set.

It keeps the Redis store's contract, including key expiry, so tests and a laptop gateway behave
like a cluster with one gateway replica. Atomicity comes from the event loop: no method awaits
between reading state and writing it, so concurrent tasks cannot interleave inside a take. It is
per-process by design: two gateway replicas on ``MemoryStore`` have two budgets.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from serve_app.store.base import (
    Bucket,
    Store,
    StoreError,
    TakeResult,
    check_take,
    check_ttl,
    covers,
    retry_after,
)

Kind = Literal["bucket", "lease"]

# Expired keys are dropped when read, and in one sweep of the whole keyspace at most this often,
# so keys nobody reads again (a departed tenant, a cold cache entry) do not accumulate.
SWEEP_INTERVAL_S = 10.0


@dataclass(slots=True)
class _Entry:
    kind: Kind
    value: Any  # bucket: (level, last_refill); lease: {lease_id: expires_at}
    expires_at: float


class MemoryStore(Store):
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._data: dict[str, _Entry] = {}
        self._last_sweep = clock()

    def __len__(self) -> int:
        """Live and not-yet-swept keys (for tests of the expiry bound)."""
        return len(self._data)

    # -- keyspace ---------------------------------------------------------------------------

    def _live(self, key: str, kind: Kind, now: float) -> _Entry | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        if entry.expires_at <= now:
            del self._data[key]
            return None
        if entry.kind != kind:
            # Redis answers WRONGTYPE here; the memory store fails the same way.
            raise StoreError(f"key {key!r} holds {entry.kind}, not {kind}")
        return entry

    def _put(self, key: str, kind: Kind, value: Any, expires_at: float, now: float) -> None:
        self._data[key] = _Entry(kind, value, expires_at)
        if now - self._last_sweep >= SWEEP_INTERVAL_S:
            self._last_sweep = now
            expired = [k for k, e in self._data.items() if e.expires_at <= now]
            for k in expired:
                del self._data[k]

    # -- buckets ----------------------------------------------------------------------------

    def _level(self, bucket: Bucket, now: float) -> float:
        entry = self._live(bucket.key, "bucket", now)
        if entry is None:
            return bucket.capacity
        level, last_refill = entry.value
        return bucket.refilled(level, now - last_refill)

    def _store_level(self, bucket: Bucket, level: float, now: float) -> None:
        self._put(bucket.key, "bucket", (level, now), now + bucket.ttl_s(level), now)

    async def take(self, buckets: Sequence[Bucket], amounts: Sequence[float]) -> TakeResult:
        check_take(buckets, amounts)
        now = self._clock()
        levels = [self._level(bucket, now) for bucket in buckets]
        if not all(covers(level, amount) for level, amount in zip(levels, amounts, strict=True)):
            return TakeResult(False, tuple(levels), retry_after(buckets, amounts, levels))
        remaining = []
        for bucket, amount, level in zip(buckets, amounts, levels, strict=True):
            self._store_level(bucket, level - amount, now)
            remaining.append(level - amount)
        return TakeResult(True, tuple(remaining), 0.0)

    async def adjust(self, bucket: Bucket, delta: float) -> float:
        if not math.isfinite(delta):
            raise ValueError(f"adjust delta must be finite, got {delta}")
        now = self._clock()
        level = min(bucket.capacity, self._level(bucket, now) + delta)
        self._store_level(bucket, level, now)
        return level

    async def peek(self, buckets: Sequence[Bucket]) -> tuple[float, ...]:
        now = self._clock()
        return tuple(self._level(bucket, now) for bucket in buckets)

    # -- leases -----------------------------------------------------------------------------

    def _holders(self, key: str, now: float) -> dict[str, float]:
        entry = self._live(key, "lease", now)
        if entry is None:
            return {}
        return {lease: exp for lease, exp in entry.value.items() if exp > now}

    def _store_holders(self, key: str, holders: dict[str, float], now: float) -> None:
        if holders:
            self._put(key, "lease", holders, max(holders.values()), now)
        else:
            self._data.pop(key, None)

    async def acquire_lease(
        self, key: str, lease_id: str, limit: int, ttl_s: float
    ) -> tuple[bool, int]:
        check_ttl(ttl_s)
        now = self._clock()
        holders = self._holders(key, now)
        granted = lease_id in holders or len(holders) < limit
        if granted:
            holders[lease_id] = now + ttl_s
        self._store_holders(key, holders, now)
        return granted, len(holders)

    async def renew_lease(self, key: str, lease_id: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        now = self._clock()
        holders = self._holders(key, now)
        held = lease_id in holders
        if held:
            holders[lease_id] = now + ttl_s
        self._store_holders(key, holders, now)
        return held

    async def release_lease(self, key: str, lease_id: str) -> None:
        now = self._clock()
        holders = self._holders(key, now)
        holders.pop(lease_id, None)
        self._store_holders(key, holders, now)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
