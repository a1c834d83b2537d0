"""The Redis store: one budget shared by every gateway replica.

Each check-and-update is one server-side Lua script, so it is atomic and costs one round trip.
Scripts read the clock with ``TIME`` on the server, so replicas with skewed clocks still share one
refill timeline. Every key has a TTL: bucket keys live twice their time to refill (after which
they would be full anyway), lease sets until their last lease expires.

Key layout (``prefix`` defaults to ``forge:``; the caller names the rest):

- ``{prefix}{bucket.key}``: hash ``{level, ts}``, ``ts`` in server microseconds.
- ``{prefix}{lease key}``: sorted set of lease ids scored by expiry in server milliseconds.
- ``{prefix}{cache key}``: string, the cached value, with the caller's TTL.
- ``{prefix}{bucket.key}:once:{id}``: string, a settle id ``adjust`` has applied, for
  ``ONCE_TTL_S``.

Failures fail fast: a short socket timeout and no client retries. A retried take is not idempotent
(the first attempt may have run), and a request served unmetered is cheaper than one that waits.
The connection pool reconnects on the next call once Redis answers again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig

from serve_app.store.base import (
    EPSILON,
    MAX_BUCKET_TTL_S,
    MIN_BUCKET_TTL_S,
    ONCE_TTL_S,
    Bucket,
    Reserved,
    Store,
    StoreError,
    StoreUnavailable,
    TakeResult,
    check_take,
    check_ttl,
    leases_by_key,
    retry_after,
)

# Shared by the bucket scripts. Lua numbers are doubles: microseconds since the epoch (~1.7e15)
# are exact below 2**53, and '%.17g' keeps every digit (Lua's tostring keeps only 14).
_BUCKET_LUA = """
local function fmt(x) return string.format('%.17g', x) end
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function level_of(key, cap, rate, now)
  local s = redis.call('HMGET', key, 'level', 'ts')
  if not s[1] then return cap end
  local elapsed = math.max(0, (now - tonumber(s[2])) / 1000000)
  return math.min(cap, tonumber(s[1]) + elapsed * rate)
end
local function store_level(key, cap, rate, level, now, min_ttl, max_ttl)
  redis.call('HSET', key, 'level', fmt(level), 'ts', fmt(now))
  local ttl = max_ttl
  if rate > 0 then ttl = math.min(max_ttl, math.max(min_ttl, 2 * (cap - level) / rate)) end
  redis.call('PEXPIRE', key, math.ceil(ttl * 1000))
end
"""

# KEYS: buckets. ARGV: epsilon, min_ttl, max_ttl, then (capacity, refill_per_s, amount) per key.
# Returns {granted (1|0), level per key as a string}: levels after the take, or untouched.
_TAKE_LUA = (
    _BUCKET_LUA
    + """
local now = now_us()
local eps, min_ttl, max_ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local caps, rates, amounts, levels, granted = {}, {}, {}, {}, true
for i, key in ipairs(KEYS) do
  caps[i] = tonumber(ARGV[3 * i + 1])
  rates[i] = tonumber(ARGV[3 * i + 2])
  amounts[i] = tonumber(ARGV[3 * i + 3])
  levels[i] = level_of(key, caps[i], rates[i], now)
  if levels[i] + eps < amounts[i] then granted = false end
end
local out = {granted and 1 or 0}
for i, key in ipairs(KEYS) do
  if granted then
    levels[i] = levels[i] - amounts[i]
    store_level(key, caps[i], rates[i], levels[i], now, min_ttl, max_ttl)
  end
  out[i + 1] = fmt(levels[i])
end
return out
"""
)

# KEYS[1]: bucket; KEYS[2], if given: the call's once-key. ARGV: min_ttl, max_ttl, capacity,
# refill_per_s, delta, and with KEYS[2] the once-key's ttl in ms. Returns the level.
_ADJUST_LUA = (
    _BUCKET_LUA
    + """
local now = now_us()
local min_ttl, max_ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local cap, rate, delta = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
-- KEYS[2], if given: the call's once-key; set already, this is a repeat and changes nothing.
if KEYS[2] and not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[6]) then
  return fmt(level_of(KEYS[1], cap, rate, now))
end
local level = math.min(cap, level_of(KEYS[1], cap, rate, now) + delta)
store_level(KEYS[1], cap, rate, level, now, min_ttl, max_ttl)
return fmt(level)
"""
)

# KEYS: bucket, its once-key, lease set. ARGV: min_ttl, max_ttl, capacity, refill_per_s, delta,
# the once-key's ttl in ms, lease_id. _ADJUST_LUA (once) and the lease's ZREM in one round trip:
# a request's whole end. Returns the bucket's level.
_SETTLE_LUA = (
    _BUCKET_LUA
    + """
redis.call('ZREM', KEYS[3], ARGV[7])
local now = now_us()
local min_ttl, max_ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local cap, rate, delta = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[6]) then
  return fmt(level_of(KEYS[1], cap, rate, now))
end
local level = math.min(cap, level_of(KEYS[1], cap, rate, now) + delta)
store_level(KEYS[1], cap, rate, level, now, min_ttl, max_ttl)
return fmt(level)
"""
)

# KEYS: buckets. ARGV: (capacity, refill_per_s) per key. Returns levels; writes nothing.
_PEEK_LUA = (
    _BUCKET_LUA
    + """
local now = now_us()
local out = {}
for i, key in ipairs(KEYS) do
  out[i] = fmt(level_of(key, tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i]), now))
end
return out
"""
)

# Lease sets: members are lease ids, scores their expiry in server milliseconds. Expired members
# are dropped first, so they never count; the key expires with its last lease.
_LEASE_FUNCTIONS_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function expire_with_last(key, now)
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then redis.call('PEXPIRE', key, math.max(1, tonumber(last[2]) - now)) end
end
"""
_LEASE_LUA = (
    _LEASE_FUNCTIONS_LUA
    + """
local now = now_ms()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
"""
)

# KEYS[1]: lease set. ARGV: lease_id, limit, ttl_ms. Returns {granted (1|0), holders now}.
_ACQUIRE_LUA = (
    _LEASE_LUA
    + """
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
local count = redis.call('ZCARD', KEYS[1])
local granted = 0
if held or count < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  if not held then count = count + 1 end
  granted = 1
end
expire_with_last(KEYS[1], now)
return {granted, count}
"""
)

# KEYS: buckets, then the lease set last. ARGV: epsilon, min_ttl, max_ttl, then (capacity,
# refill_per_s, amount) per bucket, then lease_id, limit, ttl_ms. The take of _TAKE_LUA and the
# lease of _ACQUIRE_LUA, both or neither. Returns {code, holders, level per bucket}: code 1 both
# made (levels after the take), 0 a bucket refused (the lease not asked), 2 the lease refused
# (levels untouched).
_RESERVE_LUA = (
    _BUCKET_LUA
    + """
local now = now_us()
local now_ms = math.floor(now / 1000)
local lease_key = KEYS[#KEYS]
local n = #KEYS - 1
local eps, min_ttl, max_ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local caps, rates, amounts, levels, granted = {}, {}, {}, {}, true
for i = 1, n do
  caps[i] = tonumber(ARGV[3 * i + 1])
  rates[i] = tonumber(ARGV[3 * i + 2])
  amounts[i] = tonumber(ARGV[3 * i + 3])
  levels[i] = level_of(KEYS[i], caps[i], rates[i], now)
  if levels[i] + eps < amounts[i] then granted = false end
end
local lease_id = ARGV[3 * n + 4]
local limit, ttl_ms = tonumber(ARGV[3 * n + 5]), tonumber(ARGV[3 * n + 6])
local code, count = 0, 0
if granted then
  redis.call('ZREMRANGEBYSCORE', lease_key, '-inf', now_ms)
  local held = redis.call('ZSCORE', lease_key, lease_id)
  count = redis.call('ZCARD', lease_key)
  if held or count < limit then
    redis.call('ZADD', lease_key, now_ms + ttl_ms, lease_id)
    if not held then count = count + 1 end
    local last = redis.call('ZRANGE', lease_key, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', lease_key, math.max(1, tonumber(last[2]) - now_ms))
    code = 1
  else
    code = 2
  end
end
local out = {code, count}
for i = 1, n do
  if code == 1 then
    levels[i] = levels[i] - amounts[i]
    store_level(KEYS[i], caps[i], rates[i], levels[i], now, min_ttl, max_ttl)
  end
  out[i + 2] = fmt(levels[i])
end
return out
"""
)

# KEYS: buckets, then the lease set last. ARGV: min_ttl, max_ttl, then (capacity, refill_per_s,
# amount) per bucket, then lease_id. A lost _RESERVE_LUA undone: its lease is held if and only if
# it took the buckets. Returns 1 if it undid one (the lease released, the amounts refunded).
_UNRESERVE_LUA = (
    _BUCKET_LUA
    + """
local lease_key = KEYS[#KEYS]
if redis.call('ZREM', lease_key, ARGV[3 * (#KEYS - 1) + 3]) == 0 then return 0 end
local now = now_us()
local min_ttl, max_ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, #KEYS - 1 do
  local cap, rate = tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
  local level = math.min(cap, level_of(KEYS[i], cap, rate, now) + tonumber(ARGV[3 * i + 2]))
  store_level(KEYS[i], cap, rate, level, now, min_ttl, max_ttl)
end
return 1
"""
)

# KEYS[1]: lease set. ARGV: lease_id, ttl_ms. Returns 1 if the lease was held (and is extended).
_RENEW_LUA = (
    _LEASE_LUA
    + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[2]), ARGV[1])
expire_with_last(KEYS[1], now)
return 1
"""
)

# KEYS: lease sets. ARGV: ttl_ms, then per key the number of its leases and their ids. Every
# lease of _RENEW_LUA at once: a gateway's live streams, one round trip a period. Returns
# {key index, lease_id} for each lease not held (flat), which the caller acquires again.
_RENEW_MANY_LUA = (
    _LEASE_FUNCTIONS_LUA
    + """
local now = now_ms()
local ttl_ms = tonumber(ARGV[1])
local gone, at = {}, 2
for k, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local n = tonumber(ARGV[at])
  for i = at + 1, at + n do
    if redis.call('ZSCORE', key, ARGV[i]) then
      redis.call('ZADD', key, 'XX', now + ttl_ms, ARGV[i])
    else
      gone[#gone + 1] = k
      gone[#gone + 1] = ARGV[i]
    end
  end
  expire_with_last(key, now)
  at = at + n + 1
end
return gone
"""
)

# What redis-py's BlockingConnectionPool raises when no pooled connection frees up in time.
_POOL_EXHAUSTED = "No connection available."


def _ms(ttl_s: float) -> int:
    return max(1, math.ceil(ttl_s * 1000))


def _text(reply: bytes | str) -> str:
    """A string from a script's reply (bytes unless the client decodes responses)."""
    return reply.decode() if isinstance(reply, bytes) else reply


class RedisStore(Store):
    """A store on ``redis.asyncio``. It owns ``client`` and closes it on ``close``."""

    def __init__(self, client: Redis, *, key_prefix: str = "forge:") -> None:
        self._client = client
        self._prefix = key_prefix
        # Script objects send EVALSHA and reload the script themselves on NOSCRIPT.
        self._take = client.register_script(_TAKE_LUA)
        self._adjust = client.register_script(_ADJUST_LUA)
        self._peek = client.register_script(_PEEK_LUA)
        self._acquire = client.register_script(_ACQUIRE_LUA)
        self._renew = client.register_script(_RENEW_LUA)
        self._renew_many = client.register_script(_RENEW_MANY_LUA)
        self._reserve = client.register_script(_RESERVE_LUA)
        self._unreserve = client.register_script(_UNRESERVE_LUA)
        self._settle = client.register_script(_SETTLE_LUA)

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        key_prefix: str = "forge:",
        timeout_s: float = 0.05,
        max_connections: int = 50,
        client_name: str | None = "forge-gateway",
    ) -> RedisStore:
        """Connect lazily (the gateway starts even if Redis is down) with fail-fast settings.

        ``timeout_s`` bounds the connect, each reply, and the wait for a free pooled connection.
        The pool blocks (up to ``timeout_s``) when all ``max_connections`` are busy: redis-py's
        default pool would raise at once, failing a burst open, which is exactly when a
        flooding tenant must stay metered.
        """
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            client_name=client_name,
            # With maintenance notifications on ("auto" under RESP3, redis-py's default), the pool
            # skips its check for connections the server closed, so the first call after a Redis
            # restart fails on every pooled connection. They serve managed Redis failovers only.
            maint_notifications_config=MaintNotificationsConfig(enabled=False),
        )
        return cls(Redis(connection_pool=pool), key_prefix=key_prefix)

    def _key(self, key: str) -> str:
        return self._prefix + key

    @contextmanager
    def _failures(self, operation: str) -> Iterator[None]:
        try:
            yield
        except RedisConnectionError as exc:
            if str(exc) == _POOL_EXHAUSTED:
                # Our own pool was busy for timeout_s: Redis is answering the other callers, so
                # this is load (a burst), not an outage, and must not count towards skipping it.
                raise StoreError(f"redis {operation} failed: {exc}") from exc
            raise StoreUnavailable(
                f"redis {operation} failed: {type(exc).__name__}: {exc}"
            ) from exc
        except (TimeoutError, RedisTimeoutError, OSError) as exc:
            raise StoreUnavailable(
                f"redis {operation} failed: {type(exc).__name__}: {exc}"
            ) from exc
        except RedisError as exc:
            raise StoreError(f"redis {operation} failed: {type(exc).__name__}: {exc}") from exc

    # -- buckets ----------------------------------------------------------------------------

    async def take(self, buckets: Sequence[Bucket], amounts: Sequence[float]) -> TakeResult:
        check_take(buckets, amounts)
        args: list[float] = [EPSILON, MIN_BUCKET_TTL_S, MAX_BUCKET_TTL_S]
        for bucket, amount in zip(buckets, amounts, strict=True):
            args += [bucket.capacity, bucket.refill_per_s, amount]
        with self._failures("take"):
            reply = await self._take(keys=[self._key(b.key) for b in buckets], args=args)
        granted = bool(int(reply[0]))
        levels = tuple(float(level) for level in reply[1:])
        if granted:
            return TakeResult(True, levels, 0.0)
        return TakeResult(False, levels, retry_after(buckets, amounts, levels))

    async def adjust(self, bucket: Bucket, delta: float, *, once: str | None = None) -> float:
        if not math.isfinite(delta):
            raise ValueError(f"adjust delta must be finite, got {delta}")
        args = [MIN_BUCKET_TTL_S, MAX_BUCKET_TTL_S, bucket.capacity, bucket.refill_per_s, delta]
        keys = [self._key(bucket.key)]
        if once is not None:  # the bucket key's {hash tag}: one slot
            keys.append(self._key(f"{bucket.key}:once:{once}"))
            args.append(_ms(ONCE_TTL_S))
        with self._failures("adjust"):
            reply = await self._adjust(keys=keys, args=args)
        return float(reply)

    async def peek(self, buckets: Sequence[Bucket]) -> tuple[float, ...]:
        args: list[float] = []
        for bucket in buckets:
            args += [bucket.capacity, bucket.refill_per_s]
        with self._failures("peek"):
            reply = await self._peek(keys=[self._key(b.key) for b in buckets], args=args)
        return tuple(float(level) for level in reply)

    # -- leases -----------------------------------------------------------------------------

    async def acquire_lease(
        self, key: str, lease_id: str, limit: int, ttl_s: float
    ) -> tuple[bool, int]:
        check_ttl(ttl_s)
        with self._failures("acquire_lease"):
            granted, holders = await self._acquire(
                keys=[self._key(key)], args=[lease_id, int(limit), _ms(ttl_s)]
            )
        return bool(granted), int(holders)

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
        args: list[float | str] = [EPSILON, MIN_BUCKET_TTL_S, MAX_BUCKET_TTL_S]
        for bucket, amount in zip(buckets, amounts, strict=True):
            args += [bucket.capacity, bucket.refill_per_s, amount]
        args += [lease_id, int(limit), _ms(ttl_s)]
        keys = [self._key(b.key) for b in buckets] + [self._key(lease_key)]
        with self._failures("reserve"):
            reply = await self._reserve(keys=keys, args=args)
        code, holders = int(reply[0]), int(reply[1])
        levels = tuple(float(level) for level in reply[2:])
        if code == 1:
            return Reserved(TakeResult(True, levels, 0.0), holders)
        if code == 2:
            return Reserved(TakeResult(False, levels, 0.0), holders, "lease")
        refused = TakeResult(False, levels, retry_after(buckets, amounts, levels))
        return Reserved(refused, 0, "buckets")

    async def unreserve(
        self, buckets: Sequence[Bucket], amounts: Sequence[float], lease_key: str, lease_id: str
    ) -> bool:
        args: list[float | str] = [MIN_BUCKET_TTL_S, MAX_BUCKET_TTL_S]
        for bucket, amount in zip(buckets, amounts, strict=True):
            args += [bucket.capacity, bucket.refill_per_s, amount]
        args.append(lease_id)
        keys = [self._key(b.key) for b in buckets] + [self._key(lease_key)]
        with self._failures("unreserve"):
            return bool(await self._unreserve(keys=keys, args=args))

    async def settle(
        self, bucket: Bucket, delta: float, once: str, lease_key: str, lease_id: str
    ) -> None:
        if not math.isfinite(delta):
            raise ValueError(f"settle delta must be finite, got {delta}")
        keys = [  # the bucket key's {hash tag} names the once-key's slot, as in ``adjust``
            self._key(bucket.key),
            self._key(f"{bucket.key}:once:{once}"),
            self._key(lease_key),
        ]
        args: list[float | str] = [MIN_BUCKET_TTL_S, MAX_BUCKET_TTL_S, bucket.capacity]
        args += [bucket.refill_per_s, delta, _ms(ONCE_TTL_S), lease_id]
        with self._failures("settle"):
            await self._settle(keys=keys, args=args)

    async def renew_lease(self, key: str, lease_id: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        with self._failures("renew_lease"):
            held = await self._renew(keys=[self._key(key)], args=[lease_id, _ms(ttl_s)])
        return bool(held)

    async def renew_leases(
        self, leases: Sequence[tuple[str, str]], ttl_s: float
    ) -> list[tuple[str, str]]:
        """One script over every tenant's lease set: one Redis (what this store connects to)
        runs it whole; a Redis Cluster would need one call per hash slot."""
        check_ttl(ttl_s)
        grouped = leases_by_key(leases)
        if not grouped:
            return []
        args: list[int | str] = [_ms(ttl_s)]
        for lease_ids in grouped.values():
            args.append(len(lease_ids))
            args += lease_ids
        keys = list(grouped)
        with self._failures("renew_leases"):
            reply = await self._renew_many(keys=[self._key(k) for k in keys], args=args)
        return [
            (keys[int(index) - 1], _text(lease_id))
            for index, lease_id in zip(reply[::2], reply[1::2], strict=True)
        ]

    async def release_lease(self, key: str, lease_id: str) -> None:
        with self._failures("release_lease"):
            await self._client.zrem(self._key(key), lease_id)

    # -- cache ------------------------------------------------------------------------------

    async def cache_get(self, key: str) -> bytes | None:
        with self._failures("cache_get"):
            return await self._client.get(self._key(key))

    async def cache_put(self, key: str, value: bytes, ttl_s: float) -> None:
        check_ttl(ttl_s)
        with self._failures("cache_put"):
            await self._client.set(self._key(key), value, px=_ms(ttl_s))

    async def cache_delete(self, key: str) -> bool:
        with self._failures("cache_delete"):
            return bool(await self._client.delete(self._key(key)))

    async def ping(self) -> None:
        with self._failures("ping"):
            await self._client.ping()

    async def close(self) -> None:
        with self._failures("close"):
            await self._client.aclose(close_connection_pool=True)
