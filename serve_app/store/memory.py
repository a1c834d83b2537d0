"""The embedded store: one process's memory, the laptop default when no ``redis_url`` is set.

It keeps the Redis store's contract, including key expiry, so tests and a laptop gateway behave
like a cluster with one gateway replica. Atomicity comes from the event loop: no method awaits
between reading state and writing it, so concurrent tasks cannot interleave inside a take. It is
per-process by design: two gateway replicas on ``MemoryStore`` have two budgets.

Cached responses are the one kind of key it may drop before expiry: they share a byte cap
(``max_cache_bytes``), and a put that would exceed it evicts the least recently used entries
first. A dropped cache entry is a miss; buckets, leases and settle ids are state, never evicted.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from serve_app.store.base import (
    ONCE_TTL_S,
    Bucket,
    Reserved,
    Store,
    StoreError,
    TakeResult,
    check_take,
    check_ttl,
    covers,
    leases_by_key,
    retry_after,
)

Kind = Literal["bucket", "lease", "cache", "once"]

DEFAULT_MAX_CACHE_BYTES = 64 * 1024 * 1024

# Expired keys are dropped when read; keys nobody reads again (a departed tenant, a cold cache
# entry) are dropped by the first writes at most this long after they expired, so they do not
# accumulate. Keys are filed by expiry in slots of half that; each write drops (or, for a key
# whose expiry moved on, files again) at most SWEEP_BATCH keys of slots that have passed. No write
# scans the keyspace: a sweep of every key was a pause of milliseconds per 10,000 tenants.
SWEEP_INTERVAL_S = 10.0
SWEEP_BATCH = 256
_SLOT_S = SWEEP_INTERVAL_S / 2


@dataclass(slots=True)
class _Entry:
    kind: Kind
    # bucket: (level, last_refill); lease: {lease_id: expires_at}; cache: bytes; once: True
    value: Any
    expires_at: float
    slot: int = 0  # the expiry slot the key is filed in: never after its expiry's own


class MemoryStore(Store):
    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_cache_bytes: int = DEFAULT_MAX_CACHE_BYTES,
    ) -> None:
        if max_cache_bytes < 0:
            raise ValueError(f"max_cache_bytes must be >= 0, got {max_cache_bytes}")
        self._clock = clock
        self._data: dict[str, _Entry] = {}
        # Cache keys, least recently used first, with each one's size (len(key) + len(value)),
        # and their total: every path that drops a key goes through ``_drop`` to keep it exact.
        self._max_cache_bytes = max_cache_bytes
        self._lru: OrderedDict[str, int] = OrderedDict()
        self._cache_bytes = 0
        # Expiry slot → keys filed in it (a key deleted or filed again since may linger in an
        # old slot; the sweep skips it), and a heap of those slots, earliest first.
        self._slots: dict[int, set[str]] = {}
        self._due: list[int] = []
        self._sweeping: tuple[int, Iterator[str]] | None = None  # a passed slot, part swept

    def __len__(self) -> int:
        """Live and not-yet-swept keys (for tests of the expiry bound)."""
        return len(self._data)

    @property
    def cache_bytes(self) -> int:
        """The size of the cache entries held, expired ones not yet swept included."""
        return self._cache_bytes

    # -- keyspace ---------------------------------------------------------------------------

    def _live(self, key: str, kind: Kind, now: float) -> _Entry | None:
        entry = self._data.get(key)
        if entry is None:
            return None
        if entry.expires_at <= now:
            self._drop(key)
            return None
        if entry.kind != kind:
            # Redis answers WRONGTYPE here; the memory store fails the same way.
            raise StoreError(f"key {key!r} holds {entry.kind}, not {kind}")
        return entry

    def _put(self, key: str, kind: Kind, value: Any, expires_at: float, now: float) -> None:
        entry = self._data.get(key)
        if entry is None:
            entry = self._data[key] = _Entry(kind, value, expires_at)
            self._file(key, entry)
        else:
            # Updated in place: a new entry per write would outlive the request whenever the
            # key is not written again soon (many tenants), and every such survivor is one more
            # object for the garbage collector's older generations to track and scan.
            entry.kind, entry.value, entry.expires_at = kind, value, expires_at
            if expires_at < entry.slot * _SLOT_S:  # it now expires before its slot: file earlier
                self._file(key, entry)
        self._sweep(now)

    def _drop(self, key: str) -> None:
        self._data.pop(key, None)
        self._cache_bytes -= self._lru.pop(key, 0)

    def _file(self, key: str, entry: _Entry) -> None:
        entry.slot = int(entry.expires_at // _SLOT_S)
        keys = self._slots.get(entry.slot)
        if keys is None:
            keys = self._slots[entry.slot] = set()
            heapq.heappush(self._due, entry.slot)
        keys.add(key)

    def _sweep(self, now: float) -> None:
        """Drop the expired keys of slots that have passed, at most ``SWEEP_BATCH`` of them;
        a key of such a slot that expires later (its expiry moved on) is filed again."""
        budget = SWEEP_BATCH
        while True:
            if self._sweeping is None:
                if not self._due or (self._due[0] + 1) * _SLOT_S > now:
                    return
                slot = heapq.heappop(self._due)
                self._sweeping = (slot, iter(self._slots.pop(slot)))
            slot, keys = self._sweeping
            for key in keys:
                entry = self._data.get(key)
                if entry is not None and entry.slot == slot:
                    if entry.expires_at <= now:
                        self._drop(key)
                    else:
                        self._file(key, entry)
                budget -= 1
                if budget == 0:
                    return  # the rest of this slot waits for the next write
            self._sweeping = None

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

    async def adjust(self, bucket: Bucket, delta: float, *, once: str | None = None) -> float:
        if not math.isfinite(delta):
            raise ValueError(f"adjust delta must be finite, got {delta}")
        now = self._clock()
        if once is not None:
            seen = f"{bucket.key}:once:{once}"
            if self._live(seen, "once", now) is not None:
                return self._level(bucket, now)
            self._put(seen, "once", True, now + ONCE_TTL_S, now)
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
            self._drop(key)

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

    async def reserve(
        self,
        buckets: Sequence[Bucket],
        amounts: Sequence[float],
        lease_key: str,
        lease_id: str,
        limit: int,
        ttl_s: float,
    ) -> Reserved:
        check_take(buckets, amounts)
        check_ttl(ttl_s)
        now = self._clock()
        levels = [self._level(bucket, now) for bucket in buckets]
        if not all(covers(level, amount) for level, amount in zip(levels, amounts, strict=True)):
            refused = TakeResult(False, tuple(levels), retry_after(buckets, amounts, levels))
            return Reserved(refused, 0, "buckets")
        holders = self._holders(lease_key, now)
        if lease_id not in holders and len(holders) >= limit:
            return Reserved(TakeResult(False, tuple(levels), 0.0), len(holders), "lease")
        holders[lease_id] = now + ttl_s
        self._store_holders(lease_key, holders, now)
        remaining = []
        for bucket, amount, level in zip(buckets, amounts, levels, strict=True):
            self._store_level(bucket, level - amount, now)
            remaining.append(level - amount)
        return Reserved(TakeResult(True, tuple(remaining), 0.0), len(holders))

    async def unreserve(
        self, buckets: Sequence[Bucket], amounts: Sequence[float], lease_key: str, lease_id: str
    ) -> bool:
        now = self._clock()
        holders = self._holders(lease_key, now)
        if holders.pop(lease_id, None) is None:
            return False
        self._store_holders(lease_key, holders, now)
        for bucket, amount in zip(buckets, amounts, strict=True):
            self._store_level(bucket, min(bucket.capacity, self._level(bucket, now) + amount), now)
        return True

    async def renew_lease(self, key: str, lease_id: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        now = self._clock()
        holders = self._holders(key, now)
        held = lease_id in holders
        if held:
            holders[lease_id] = now + ttl_s
        self._store_holders(key, holders, now)
        return held

    async def renew_leases(
        self, leases: Sequence[tuple[str, str]], ttl_s: float
    ) -> list[tuple[str, str]]:
        check_ttl(ttl_s)
        now = self._clock()
        gone: list[tuple[str, str]] = []
        for key, lease_ids in leases_by_key(leases).items():
            holders = self._holders(key, now)
            for lease_id in lease_ids:
                if lease_id in holders:
                    holders[lease_id] = now + ttl_s
                else:
                    gone.append((key, lease_id))
            self._store_holders(key, holders, now)
        return gone

    async def release_lease(self, key: str, lease_id: str) -> None:
        now = self._clock()
        holders = self._holders(key, now)
        holders.pop(lease_id, None)
        self._store_holders(key, holders, now)

    # -- cache ------------------------------------------------------------------------------

    async def cache_get(self, key: str) -> bytes | None:
        entry = self._live(key, "cache", self._clock())
        if entry is None:
            return None
        self._lru.move_to_end(key)
        return entry.value

    async def cache_delete(self, key: str) -> bool:
        held = self._live(key, "cache", self._clock()) is not None
        self._drop(key)
        return held

    async def cache_put(self, key: str, value: bytes, ttl_s: float) -> None:
        check_ttl(ttl_s)
        now = self._clock()
        size = len(key) + len(value)
        if size > self._max_cache_bytes:
            # Evicting everything would not make room; the old value must not outlive the put.
            self._drop(key)
            return
        # The old value (of any kind: ``SET`` replaces any) is updated in place; its bytes leave
        # the total first, so this key is never among the evicted.
        self._cache_bytes -= self._lru.pop(key, 0)
        while self._cache_bytes + size > self._max_cache_bytes:
            self._drop(next(iter(self._lru)))
        self._put(key, "cache", bytes(value), now + ttl_s, now)
        self._lru[key] = size
        self._cache_bytes += size

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
