"""The store: what the gateway keeps outside a request, shared by every gateway replica.

Token buckets (quotas), stream leases (concurrent-stream caps) and cached responses. (Usage is
not here: it is billed from, so it lives in the durable ledger, ``serve_app/metering/book.py``.)
Two implementations keep one contract: Redis for a cluster of gateway replicas, and an embedded
in-process store for a laptop.
Quotas are a convenience, so every backend failure surfaces as ``StoreError`` and the gateway
fails open with a single ``except StoreError``; a store that cannot be reached at all raises its
subclass ``StoreUnavailable``, which is what ``GuardedStore`` counts towards skipping the store
for a while. Bad arguments are programming errors and raise ``ValueError``.

Bucket arithmetic (both stores): a bucket starts full; its level refills continuously,
``level = min(capacity, level + elapsed * refill_per_s)``; a take of ``amount`` succeeds when
``level >= amount``. ``adjust`` may push the level below zero (a charged overshoot): that debt is
repaid by refill before the bucket grants again. Keys are namespaced by the caller
(``quota:{tenant}:rpm``); in a Redis Cluster every bucket of one ``take`` must share a hash slot,
so put the tenant in a ``{hash tag}``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

# A take compares floats that went through refill arithmetic; forgive rounding noise so a bucket
# refilled to exactly ``amount`` grants.
EPSILON = 1e-9

# A bucket key lives twice as long as a refill from its current level to full: by then the bucket
# would be full anyway, so expiry is invisible. Bounded on both sides: at least a few seconds, and
# at most a day, so a tenant that went away (or a bucket with no refill) cannot pin a key forever.
MIN_BUCKET_TTL_S = 5.0
MAX_BUCKET_TTL_S = 86_400.0

# How long ``adjust(once=...)`` remembers a settle's id: far longer than a settle is retried
# (``Settles.deadline_s``), so the latest retry of a settle whose reply was lost is still known.
ONCE_TTL_S = 3600.0


class StoreError(Exception):
    """The store failed (unreachable, timed out, script or type error). The caller fails open."""


class StoreUnavailable(StoreError):
    """The store could not be reached or did not answer in time (not: it answered an error)."""


class StoreSkipped(StoreUnavailable):
    """The call was never sent: the store is known down (``GuardedStore``). Nothing it would
    have changed changed, so nothing needs undoing."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """A token bucket: ``capacity`` is the burst, ``refill_per_s`` the sustained rate."""

    key: str
    capacity: float
    refill_per_s: float

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("Bucket.key must not be empty")
        if not (self.capacity >= 0 and math.isfinite(self.capacity)):
            raise ValueError(f"Bucket.capacity must be finite and >= 0, got {self.capacity}")
        if not (self.refill_per_s >= 0 and math.isfinite(self.refill_per_s)):
            raise ValueError(
                f"Bucket.refill_per_s must be finite and >= 0, got {self.refill_per_s}"
            )

    def refilled(self, level: float, elapsed_s: float) -> float:
        """The level after ``elapsed_s`` seconds of continuous refill."""
        return min(self.capacity, level + max(0.0, elapsed_s) * self.refill_per_s)

    def ttl_s(self, level: float) -> float:
        """How long the key for this bucket at ``level`` must live (see ``MIN_BUCKET_TTL_S``)."""
        if self.refill_per_s <= 0:
            return MAX_BUCKET_TTL_S
        to_full = 2 * (self.capacity - level) / self.refill_per_s
        return min(MAX_BUCKET_TTL_S, max(MIN_BUCKET_TTL_S, to_full))


@dataclass(frozen=True, slots=True)
class TakeResult:
    """The outcome of an all-or-nothing take across buckets.

    ``remaining`` holds each bucket's level after the take, or its untouched level if the take was
    refused. ``retry_after_s`` is 0 when granted; otherwise the seconds until every bucket could
    cover its amount, ``inf`` when one never can (amount above capacity, or no refill).
    """

    granted: bool
    remaining: tuple[float, ...]
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class Reserved:
    """A request's take and its lease, made together (``Store.reserve``): both or neither.

    ``refused``: None (both made), "buckets" (a bucket cannot cover its amount: nothing taken,
    the lease not asked) or "lease" (the buckets could, but ``limit`` leases are held: nothing
    taken). ``take`` is the buckets' outcome (its levels after the take, or untouched);
    ``holders`` the leases under the key now, this one included when granted."""

    take: TakeResult
    holders: int
    refused: str | None = None


def check_take(buckets: Sequence[Bucket], amounts: Sequence[float]) -> None:
    if not buckets:
        raise ValueError("take needs at least one bucket")
    if len(buckets) != len(amounts):
        raise ValueError(f"{len(buckets)} buckets but {len(amounts)} amounts")
    for amount in amounts:
        if not (amount >= 0 and math.isfinite(amount)):
            raise ValueError(f"take amounts must be finite and >= 0, got {amount}; use adjust")


def check_ttl(ttl_s: float) -> None:
    if not (ttl_s > 0 and math.isfinite(ttl_s)):
        raise ValueError(f"ttl_s must be finite and > 0, got {ttl_s}")


def leases_by_key(leases: Sequence[tuple[str, str]]) -> dict[str, list[str]]:
    """``(key, lease_id)`` pairs grouped by key: each lease set is read and written once."""
    grouped: dict[str, list[str]] = {}
    for key, lease_id in leases:
        grouped.setdefault(key, []).append(lease_id)
    return grouped


def covers(level: float, amount: float) -> bool:
    return level + EPSILON >= amount


def retry_after(
    buckets: Sequence[Bucket], amounts: Sequence[float], levels: Sequence[float]
) -> float:
    """Seconds until every bucket holds its amount: the slowest bucket's deficit over its rate."""
    wait = 0.0
    for bucket, amount, level in zip(buckets, amounts, levels, strict=True):
        if covers(level, amount):
            continue
        if amount > bucket.capacity + EPSILON or bucket.refill_per_s <= 0:
            return math.inf
        wait = max(wait, (amount - level) / bucket.refill_per_s)
    return wait


class Store(ABC):
    """Shared gateway state. Every method raises ``StoreError`` when the backend fails."""

    @abstractmethod
    async def take(self, buckets: Sequence[Bucket], amounts: Sequence[float]) -> TakeResult:
        """Take ``amounts[i]`` from ``buckets[i]`` for every i, or nothing at all."""

    @abstractmethod
    async def adjust(self, bucket: Bucket, delta: float, *, once: str | None = None) -> float:
        """Settle a reservation: ``+delta`` refunds (capped at capacity), ``-delta`` charges an
        overshoot (the level may go negative). Returns the new level.

        ``once``: an id that makes the call idempotent for ``ONCE_TTL_S`` (a repeat changes
        nothing and returns the level): a settle that timed out may have been applied, so its
        retry carries the first try's id."""

    @abstractmethod
    async def peek(self, buckets: Sequence[Bucket]) -> tuple[float, ...]:
        """Current levels after refill, changing nothing (for ``x-ratelimit-remaining-*``)."""

    @abstractmethod
    async def acquire_lease(
        self, key: str, lease_id: str, limit: int, ttl_s: float
    ) -> tuple[bool, int]:
        """Hold one of ``limit`` leases under ``key`` for ``ttl_s``. Returns (granted, holders
        now). Expired leases do not count; acquiring a lease already held renews it."""

    async def reserve(
        self,
        buckets: Sequence[Bucket],
        amounts: Sequence[float],
        lease_key: str,
        lease_id: str,
        limit: int,
        ttl_s: float,
    ) -> Reserved:
        """``take`` and ``acquire_lease`` as one: the buckets are taken only with the lease, and
        the lease held only with the buckets (a request refused its lease owes no refund). One
        round trip where the store can (Redis: one script). This default makes the two calls,
        and gives the take back if the lease is refused."""
        taken = await self.take(buckets, amounts)
        if not taken.granted:
            return Reserved(taken, 0, "buckets")
        granted, holders = await self.acquire_lease(lease_key, lease_id, limit, ttl_s)
        if granted:
            return Reserved(taken, holders)
        for bucket, amount in zip(buckets, amounts, strict=True):
            await self.adjust(bucket, amount)
        untouched = tuple(level + a for level, a in zip(taken.remaining, amounts, strict=True))
        return Reserved(TakeResult(False, untouched, 0.0), holders, "lease")

    async def unreserve(
        self, buckets: Sequence[Bucket], amounts: Sequence[float], lease_key: str, lease_id: str
    ) -> bool:
        """Undo a ``reserve`` whose answer was lost, exactly: its lease is held if and only if
        it took the buckets, so the lease is released and the amounts refunded when it is held,
        and nothing happens when it is not (the reserve never ran, was refused, or is undone
        already). True if it undid one. This default is not atomic (a store that implements
        ``reserve`` in one step implements this in one too)."""
        if not await self.renew_lease(lease_key, lease_id, 1.0):
            return False
        await self.release_lease(lease_key, lease_id)
        for bucket, amount in zip(buckets, amounts, strict=True):
            await self.adjust(bucket, amount)
        return True

    async def settle(
        self, bucket: Bucket, delta: float, once: str, lease_key: str, lease_id: str
    ) -> None:
        """A request's end in one call: ``adjust(bucket, delta, once=once)`` and the lease back
        (``release_lease``). Both are safe to repeat, so a settle whose answer was lost is sent
        again whole. One round trip where the store can (Redis: one script); this default makes
        the two calls."""
        await self.adjust(bucket, delta, once=once)
        await self.release_lease(lease_key, lease_id)

    @abstractmethod
    async def renew_lease(self, key: str, lease_id: str, ttl_s: float) -> bool:
        """Extend a held lease to ``ttl_s`` from now; False if it is not held (or expired)."""

    @abstractmethod
    async def renew_leases(
        self, leases: Sequence[tuple[str, str]], ttl_s: float
    ) -> list[tuple[str, str]]:
        """``renew_lease`` for many ``(key, lease_id)`` at once, in one round trip: a gateway
        renews the leases of all its live streams together, not a call per stream. Returns
        those not held (expired, released, or lost with the store's data), for the caller to
        acquire again or let go."""

    @abstractmethod
    async def release_lease(self, key: str, lease_id: str) -> None:
        """Give a lease back. Idempotent: releasing an unknown lease is a no-op."""

    @abstractmethod
    async def cache_get(self, key: str) -> bytes | None:
        """The cached value, or None (absent or expired): a miss is always a safe answer."""

    @abstractmethod
    async def cache_put(self, key: str, value: bytes, ttl_s: float) -> None:
        """Store ``value`` under ``key`` for ``ttl_s``, replacing whatever the key held (as Redis
        ``SET`` does). The embedded store may drop it early to stay within its size cap."""

    @abstractmethod
    async def cache_delete(self, key: str) -> bool:
        """Forget ``key``; True if it held a value (a stored response a client deletes)."""

    @abstractmethod
    async def ping(self) -> None:
        """Raise ``StoreError`` unless the backend answers."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections. The store is not used afterwards."""
