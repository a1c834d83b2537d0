"""Shared gateway state (token buckets, leases, cached answers) behind one interface."""

from serve_app.store.base import (
    Bucket,
    Reserved,
    Store,
    StoreError,
    StoreSkipped,
    StoreUnavailable,
    TakeResult,
)
from serve_app.store.factory import Stores, build_store, build_stores
from serve_app.store.guarded import GuardedStore
from serve_app.store.memory import MemoryStore
from serve_app.store.redis import RedisStore

__all__ = [
    "Bucket",
    "GuardedStore",
    "MemoryStore",
    "RedisStore",
    "Reserved",
    "Store",
    "StoreError",
    "StoreSkipped",
    "StoreUnavailable",
    "Stores",
    "TakeResult",
    "build_store",
    "build_stores",
]
