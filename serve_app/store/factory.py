"""Pick the store from config: Redis when one is configured, else the embedded store."""

from __future__ import annotations

from collections.abc import Callable

from serve_app.config.models import StoreConfig
from serve_app.resilience.breaker import State
from serve_app.resilience.settings import breaker_settings
from serve_app.store.base import Store
from serve_app.store.guarded import GuardedStore
from serve_app.store.memory import MemoryStore
from serve_app.store.redis import RedisStore


def build_store(
    config: StoreConfig,
    *,
    max_cache_bytes: int = 64 * 1024 * 1024,
    timeout_s: float | None = None,
    on_state: Callable[[State], None] | None = None,
) -> Store:
    """A guarded ``RedisStore`` (connected lazily) when Redis is configured, else a
    ``MemoryStore`` holding at most ``max_cache_bytes`` of cached answers. Raises
    ``ConfigError`` when Redis is configured by an unset variable.

    ``timeout_s`` bounds each Redis connect and reply: the store is on the request path and fails
    open, so it should cost a request milliseconds, not seconds, when Redis is slow or gone; and
    once it is known gone, nothing (``GuardedStore``). A store for work off the request path
    (usage) passes a longer ``timeout_s``.
    """
    url = config.resolved_url()
    if not url:
        return MemoryStore(max_cache_bytes=max_cache_bytes)
    redis = RedisStore.from_url(
        url, key_prefix=config.key_prefix, timeout_s=timeout_s or config.timeout_s
    )
    return GuardedStore(redis, breaker_settings(config.breaker), on_state=on_state)
