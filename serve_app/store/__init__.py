"""Shared gateway state (buckets, leases, cache entries, counters) behind one interface."""

from serve_app.store.base import Bucket, Store, StoreError, TakeResult
from serve_app.store.factory import build_store
from serve_app.store.memory import MemoryStore
from serve_app.store.redis import RedisStore

__all__ = [
    "Bucket",
    "MemoryStore",
    "RedisStore",
    "Store",
    "StoreError",
    "TakeResult",
    "build_store",
]
