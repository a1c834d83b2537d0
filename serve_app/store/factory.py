"""Pick the store from config: Redis when a URL is configured, else the embedded store."""

from __future__ import annotations

from serve_app.store.base import Store
from serve_app.store.memory import MemoryStore
from serve_app.store.redis import RedisStore


def build_store(
    redis_url: str | None, *, key_prefix: str = "forge:", timeout_s: float = 0.05
) -> Store:
    """A ``RedisStore`` for ``redis_url`` (connected lazily), or a ``MemoryStore`` without one.

    ``timeout_s`` bounds each Redis connect and reply: the store is on the request path and fails
    open, so it should cost a request milliseconds, not seconds, when Redis is slow or gone.
    """
    if not redis_url:
        return MemoryStore()
    return RedisStore.from_url(redis_url, key_prefix=key_prefix, timeout_s=timeout_s)
