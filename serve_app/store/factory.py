"""Pick the stores from config: Redis when one is configured, else the embedded store."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from serve_app.config.models import CacheStoreConfig, ForgeConfig, StoreConfig
from serve_app.resilience.breaker import State
from serve_app.resilience.settings import breaker_settings
from serve_app.store.base import Store
from serve_app.store.guarded import GuardedStore
from serve_app.store.memory import MemoryStore


def build_store(
    config: StoreConfig | CacheStoreConfig,
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
    # Here, not at the top: a replica with no Redis configured never loads redis-py (~8 MiB
    # of every gateway process, docs/benchmarks.md "Memory").
    from serve_app.store.redis import RedisStore

    redis = RedisStore.from_url(
        url, key_prefix=config.key_prefix, timeout_s=timeout_s or config.timeout_s
    )
    return GuardedStore(redis, breaker_settings(config.breaker), on_state=on_state)


@dataclass(frozen=True, slots=True)
class Stores:
    """A gateway replica's stores, by what they hold."""

    main: Store  # budgets, stream leases and settles' ids: the request path's timeout
    usage: Store | None  # the same Redis with a patient timeout, for settles; None: ``main``
    cache: Store  # cached answers: ``main``, unless ``cache.store`` names a Redis of its own


def build_stores(
    config: ForgeConfig,
    *,
    main: Store | None = None,
    on_state: Callable[[str, State], None] | None = None,
) -> Stores:
    """The stores the config names. Raises ``ConfigError`` (start-up stops) when a Redis is
    configured by an unset variable, the cache's own as much as the main one.

    ``main``: a store handed in (a test's) holds the budgets and the settles. ``on_state`` hears
    each Redis store's breaker change with the store's name, ``"main"`` or ``"cache"``: each
    has a breaker of its own, so a lost cache Redis is skipped without the budgets' being.
    """

    def state_of(name: str) -> Callable[[State], None] | None:
        return None if on_state is None else lambda state: on_state(name, state)

    usage = None
    if main is None:
        main = build_store(
            config.store,
            max_cache_bytes=config.cache.max_memory_bytes,
            on_state=state_of("main"),
        )
        if config.store.shared:  # Redis: its own connections, with a patient timeout
            usage = build_store(config.store, timeout_s=config.store.background_timeout_s)
    cache = main
    if config.cache.enabled and config.cache.store is not None:
        cache = build_store(config.cache.store, on_state=state_of("cache"))
    return Stores(main, usage, cache)
