"""API keys → tenants. Keys exist only as SHA-256 digests; comparison is constant-time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable

from serve_app import errors
from serve_app.config import TenantConfig

KEY_PREFIX = "sk-forge-"
_NO_MATCH = "0" * 64


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class KeyRing:
    """Resolves a bearer token to its tenant without ever holding a plaintext key.

    The dict is keyed by digest, so the lookup itself only ever touches digests of what the
    client sent; the final ``compare_digest`` keeps the match constant-time as well.
    """

    def __init__(self, tenants: Iterable[TenantConfig]) -> None:
        self._by_hash: dict[str, tuple[str, TenantConfig]] = {
            h: (h, t) for t in tenants for h in t.key_hashes
        }

    def tenant_for(self, authorization: str | None) -> TenantConfig:
        """The tenant for an ``Authorization`` header value; 401 on anything else."""
        if not authorization:
            raise errors.invalid_api_key("Missing API key: send 'Authorization: Bearer <key>'.")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise errors.invalid_api_key("Malformed Authorization header: expected 'Bearer <key>'.")
        digest = hash_key(token)
        stored, tenant = self._by_hash.get(digest, (_NO_MATCH, None))
        # Compare even on a miss so a miss costs what a hit costs.
        if not hmac.compare_digest(digest, stored) or tenant is None:
            raise errors.invalid_api_key("Incorrect API key provided.")
        return tenant
