"""API keys → tenants: the right tenant per key, rotation, and 401 for everything else."""

from __future__ import annotations

import hashlib

import pytest

from serve_app.auth import keys as auth
from serve_app.auth.keys import KEY_PREFIX, AdminKeys, KeyRing, hash_key, new_key
from serve_app.config.models import TenantConfig
from serve_app.errors import ForgeError


@pytest.fixture
def ring() -> KeyRing:
    return KeyRing(
        [
            TenantConfig(name="alpha", key_hashes=[hash_key("sk-alpha")]),
            # beta is mid-rotation: old and new keys both valid.
            TenantConfig(
                name="beta", key_hashes=[hash_key("sk-beta-old"), hash_key("sk-beta-new")]
            ),
        ]
    )


def test_each_key_resolves_to_its_tenant(ring):
    assert ring.tenant_for("Bearer sk-alpha").name == "alpha"
    assert ring.tenant_for("Bearer sk-beta-old").name == "beta"


def test_rotation_both_hashes_valid(ring):
    assert ring.tenant_for("Bearer sk-beta-old").name == "beta"
    assert ring.tenant_for("Bearer sk-beta-new").name == "beta"


def test_scheme_is_case_insensitive_and_token_trimmed(ring):
    assert ring.tenant_for("bearer sk-alpha").name == "alpha"
    assert ring.tenant_for("Bearer  sk-alpha ").name == "alpha"


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "sk-alpha",
        "Basic sk-alpha",
        "Token sk-alpha",
        "Bearer sk-unknown",
        "Bearer sk-alph",
        "Bearer " + hash_key("sk-alpha"),  # the digest itself is not a key
    ],
)
def test_bad_authorization_is_401_invalid_api_key(ring, header):
    with pytest.raises(ForgeError) as info:
        ring.tenant_for(header)
    err = info.value
    assert (err.status, err.code) == (401, "invalid_api_key")
    assert err.headers["www-authenticate"] == "Bearer"


def test_missing_and_wrong_key_messages_differ(ring):
    with pytest.raises(ForgeError, match="Missing API key"):
        ring.tenant_for(None)
    with pytest.raises(ForgeError, match="Malformed"):
        ring.tenant_for("Basic abc")
    with pytest.raises(ForgeError, match="Incorrect API key"):
        ring.tenant_for("Bearer nope")


def test_hash_key_is_sha256_hex():
    assert hash_key("sk-x") == hashlib.sha256(b"sk-x").hexdigest()
    assert hash_key("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_new_key_has_prefix_and_is_unique():
    keys = {new_key() for _ in range(50)}
    assert len(keys) == 50
    for key in keys:
        assert key.startswith(KEY_PREFIX)
        assert len(key) > len(KEY_PREFIX) + 32


def test_new_key_round_trips_through_config_and_ring():
    key = new_key()
    ring = KeyRing([TenantConfig(name="t", key_hashes=[hash_key(key)])])
    assert ring.tenant_for(f"Bearer {key}").name == "t"


def test_key_hashes_file_adds_keys_for_known_tenants(tmp_path):
    from serve_app.auth.keys import load_key_hashes_file

    path = tmp_path / "keys.yaml"
    path.write_text(f"alpha: [{hash_key('sk-from-secret')}]\n")
    extra = load_key_hashes_file(str(path), ["alpha", "beta"])
    tenant = TenantConfig(name="alpha", key_hashes=[])
    ring = KeyRing([tenant], extra)
    assert ring.tenant_for("Bearer sk-from-secret").name == "alpha"


def test_a_key_file_cannot_move_a_key_to_another_tenant(tmp_path):
    """The config refuses one hash under two tenants; a key file listing a tenant's hash under
    another tenant was served as the file's tenant (its budgets, its usage), unsaid."""
    from serve_app.config.models import load_config

    path = tmp_path / "keys.yaml"
    path.write_text(f"beta: [{hash_key('sk-alpha-key')}]\n")
    config = load_config(
        {
            "tenants": [
                {"name": "alpha", "key_hashes": [hash_key("sk-alpha-key")]},
                {"name": "beta", "key_hashes": []},
            ],
            "key_hashes_file": str(path),
            "pools": [{"name": "primary", "model": "m"}],
        }
    )
    with pytest.raises(ValueError, match="listed for two tenants, 'alpha' and 'beta'"):
        KeyRing.from_config(config)


def test_a_tenants_key_from_the_key_file_is_no_admin_key(tmp_path):
    from serve_app.config.models import load_config

    keys = tmp_path / "keys.yaml"
    keys.write_text(f"alpha: [{hash_key('sk-shared')}]\n")
    config = load_config(
        {
            "tenants": [{"name": "alpha", "key_hashes": []}],
            "key_hashes_file": str(keys),
            "admin": {"key_hashes": [hash_key("sk-shared")]},
            "pools": [{"name": "primary", "model": "m"}],
        }
    )
    with pytest.raises(ValueError, match="must not be an admin key too"):
        AdminKeys.from_config(config)


@pytest.mark.parametrize(
    "content", ["gamma: []\n", "alpha: not-a-list\n", "alpha: [abc]\n", "- just a list\n"]
)
def test_key_hashes_file_rejects_unknown_tenants_and_bad_hashes(tmp_path, content):
    from serve_app.auth.keys import load_key_hashes_file

    path = tmp_path / "keys.yaml"
    path.write_text(content)
    with pytest.raises(ValueError):
        load_key_hashes_file(str(path), ["alpha"])


def test_keys_are_compared_as_digests_in_constant_time_on_a_hit_and_a_miss(monkeypatch):
    """Every lookup ends in ``hmac.compare_digest`` of two full digests, a miss included (so a
    miss costs what a hit costs), and no plaintext key ever reaches the comparison."""
    calls, real = [], auth.hmac.compare_digest
    monkeypatch.setattr(
        auth.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b)
    )
    ring = KeyRing([TenantConfig(name="alpha", key_hashes=[hash_key("sk-alpha")])])
    admins = AdminKeys([hash_key("sk-admin")])
    assert ring.tenant_for("Bearer sk-alpha").name == "alpha"
    with pytest.raises(ForgeError):
        ring.tenant_for("Bearer sk-wrong")
    assert admins.is_admin("Bearer sk-admin") and not admins.is_admin("Bearer sk-wrong")
    assert len(calls) == 4 and all(len(a) == len(b) == 64 for a, b in calls)
    assert not any("sk-" in a + b for a, b in calls)
