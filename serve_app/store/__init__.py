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


def __getattr__(name: str):
    # RedisStore on first use: a gateway with no Redis configured never loads redis-py.
    if name == "RedisStore":
        from serve_app.store.redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
