"""API keys → tenants, and operators' admin keys. Keys exist only as SHA-256 digests;
comparison is constant-time."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping, Sequence

from serve_app import errors
from serve_app.config.models import ForgeConfig, TenantConfig, is_key_hash

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

    def __init__(
        self, tenants: Iterable[TenantConfig], extra_hashes: Mapping[str, Sequence[str]] = {}
    ) -> None:
        self._by_hash: dict[str, tuple[str, TenantConfig]] = {}
        for tenant in tenants:
            for h in (*tenant.key_hashes, *extra_hashes.get(tenant.name, ())):
                held = self._by_hash.get(h)
                if held is not None and held[1].name != tenant.name:
                    # The config refuses this within its own tenants; a key file must not
                    # quietly move a key to another tenant either.
                    raise ValueError(
                        f"key hash {h[:12]}... is listed for two tenants, {held[1].name!r} and "
                        f"{tenant.name!r} (the config's tenants and key_hashes_file): one key, "
                        "one tenant"
                    )
                self._by_hash[h] = (h, tenant)

    @property
    def hashes(self) -> set[str]:
        """Every tenant key's digest (an admin key must be none of them)."""
        return set(self._by_hash)

    @classmethod
    def from_config(cls, config: ForgeConfig) -> KeyRing:
        """The config's tenants with their hashes, plus those of the mounted ``key_hashes_file``."""
        extra = {}
        if config.key_hashes_file:
            extra = load_key_hashes_file(config.key_hashes_file, [t.name for t in config.tenants])
        return cls(config.tenants, extra)

    def tenant_for(self, authorization: str | None) -> TenantConfig:
        """The tenant for an ``Authorization`` header value; 401 on anything else."""
        digest = hash_key(bearer_token(authorization))
        stored, tenant = self._by_hash.get(digest, (_NO_MATCH, None))
        # Compare even on a miss so a miss costs what a hit costs.
        if not hmac.compare_digest(digest, stored) or tenant is None:
            raise errors.invalid_api_key("Incorrect API key provided.")
        return tenant


class AdminKeys:
    """Operators' keys, held as SHA-256 digests only and compared in constant time, like
    tenants' keys: the config's ``admin.key_hashes`` and those of its mounted
    ``admin.key_hashes_file`` (a YAML or JSON list), so admin keys rotate with a secret."""

    def __init__(self, hashes: Iterable[str]) -> None:
        self._hashes = {h: h for h in hashes}

    @classmethod
    def from_config(cls, config: ForgeConfig, tenants: KeyRing | None = None) -> AdminKeys:
        """``tenants``: the tenants' keys as served (the key file's too; read here if None)."""
        hashes = list(config.admin.key_hashes)
        if config.admin.key_hashes_file:
            hashes += load_admin_hashes_file(config.admin.key_hashes_file)
        tenants = tenants if tenants is not None else KeyRing.from_config(config)
        if tenants.hashes & set(hashes):
            raise ValueError("admin.key_hashes_file: a tenant's key must not be an admin key too")
        return cls(hashes)

    def is_admin(self, authorization: str | None) -> bool:
        """Whether the header carries an admin key; a 401 when it carries no bearer token."""
        digest = hash_key(bearer_token(authorization))
        stored = self._hashes.get(digest, _NO_MATCH)
        return hmac.compare_digest(digest, stored) and stored != _NO_MATCH


def bearer_token(authorization: str | None) -> str:
    """The token of ``Bearer <token>``; a 401 for anything else."""
    if not authorization:
        raise errors.invalid_api_key(
            "Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')."
        )
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise errors.invalid_api_key("Malformed Authorization header: expected 'Bearer <key>'.")
    return token


def load_key_hashes_file(path: str, tenant_names: Iterable[str]) -> dict[str, list[str]]:
    """Read ``{tenant: [sha256, ...]}`` from a mounted secret (YAML or JSON).

    Kept out of the config file so keys rotate by updating a secret, not a deployment.
    """
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of tenant name to a list of key hashes")
    known = set(tenant_names)
    result: dict[str, list[str]] = {}
    for tenant, hashes in data.items():
        if tenant not in known:
            raise ValueError(f"{path}: tenant {tenant!r} is not in the config's tenants")
        if not isinstance(hashes, list) or not all(is_key_hash(h) for h in hashes):
            raise ValueError(f"{path}: {tenant}: expected a list of SHA-256 hex digests")
        result[tenant] = hashes
    return result


def load_admin_hashes_file(path: str) -> list[str]:
    """Read ``[sha256, ...]`` (admin keys) from a mounted secret, YAML or JSON."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or []
    if not isinstance(data, list) or not all(is_key_hash(h) for h in data):
        raise ValueError(f"{path}: expected a list of SHA-256 hex digests (admin keys)")
    return data
