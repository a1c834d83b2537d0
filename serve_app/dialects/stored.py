"""Stored responses: what ``previous_response_id`` continues, on any gateway replica.

A response a client lets OpenAI's API store (``store``, true by default) is kept in the store
the cache uses (Redis on a cluster, so every gateway replica reads what any other wrote; the
embedded store on a laptop), under its tenant's name: another tenant's id is simply not there,
a 404, never a leak. Each record holds the response as the client saw it (``GET
/v1/responses/{id}``) and the conversation up to it as chat messages (what a follow-up sends
before its own input). It lives ``ttl_s`` and is not kept past ``max_bytes``: a conversation
grows with every turn, and a store full of them would evict the cache, or on a ``noeviction``
Redis refuse writes.
"""

from __future__ import annotations

import logging

import orjson

from serve_app import errors
from serve_app.store import Store, StoreError

logger = logging.getLogger("ray.serve")


class StoredResponses:
    def __init__(
        self, store: Store, *, ttl_s: float, max_bytes: int, on_error=lambda op, exc: None
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._on_error = on_error  # (operation, exception): counted as the store's errors

    @staticmethod
    def _key(tenant: str, response_id: str) -> str:
        # The tenant in a hash tag: one slot per tenant in a Redis Cluster, as the budgets.
        return f"responses:{{{tenant}}}:{response_id}"

    async def get(self, tenant: str, response_id: str) -> dict | None:
        """The record, or None if there is none for this tenant; a 503 if the store cannot
        say (a follow-up without its history would be a different conversation)."""
        try:
            raw = await self.store.cache_get(self._key(tenant, response_id))
        except StoreError as exc:
            self._on_error("responses_get", exc)
            raise errors.unavailable("Stored responses are", "store_unavailable") from None
        if raw is None:
            return None
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        return record if isinstance(record, dict) else None

    async def put(self, tenant: str, response_id: str, record: dict) -> bool:
        """Keep ``record``; False (logged, counted) if it is too large or the store failed:
        the answer is served all the same, and a follow-up to it is a clear 404."""
        value = orjson.dumps(record)
        if len(value) > self.max_bytes:
            logger.warning(
                "response %s not stored: %d bytes, over responses.max_stored_bytes (%d)",
                response_id,
                len(value),
                self.max_bytes,
            )
            return False
        try:
            await self.store.cache_put(self._key(tenant, response_id), value, self.ttl_s)
        except StoreError as exc:
            self._on_error("responses_put", exc)
            return False
        return True

    async def delete(self, tenant: str, response_id: str) -> bool:
        try:
            return await self.store.cache_delete(self._key(tenant, response_id))
        except StoreError as exc:
            self._on_error("responses_delete", exc)
            raise errors.unavailable("Stored responses are", "store_unavailable") from None
