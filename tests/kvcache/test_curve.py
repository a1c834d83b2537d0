"""Where the KV-event sockets' CURVE key comes from, and the config that refuses to do without."""

from __future__ import annotations

import pytest
import zmq

from serve_app.config import models
from serve_app.config.models import KvEventsConfig, PoolConfig
from serve_app.kvcache import curve
from serve_app.kvcache.curve import CurveKeys, curve_keys

ENV = KvEventsConfig().curve_secret_env


def test_this_pyzmq_has_curve():
    """The venv's libzmq is built with CURVE (pyzmq's wheels bundle libsodium): the default
    ``auth: curve`` works here, and every test below runs it for real."""
    assert zmq.has("curve")


def test_the_keypair_follows_from_its_secret():
    made = CurveKeys.generate()
    assert CurveKeys.from_secret(made.secret.decode() + "\n") == made


def test_a_bad_secret_is_named_by_where_it_came_from_never_shown():
    with pytest.raises(ValueError, match=r"\$FORGE_KV_CURVE_SECRET is not a CURVE secret") as err:
        CurveKeys.from_secret("hunter2-is-not-a-key", f"${ENV}")
    assert "hunter2" not in str(err.value)


def test_the_secret_never_shows_in_a_repr():
    keys = CurveKeys.generate()
    assert keys.secret.decode() not in repr(keys)
    assert keys.public.decode() in repr(keys)


def test_the_key_comes_from_the_variable_the_config_names(monkeypatch):
    keys = CurveKeys.generate()
    monkeypatch.setenv("MY_KV_SECRET", keys.secret.decode())
    assert curve_keys("curve", "MY_KV_SECRET") == keys


def test_without_the_variable_or_a_ray_cluster_there_is_no_key(monkeypatch):
    from ray.experimental import internal_kv

    monkeypatch.delenv("UNSET_KV_SECRET", raising=False)
    # Outside Ray, whatever else this test session has started (the e2e tests' Ray would hold
    # a cluster key in its GCS).
    monkeypatch.setattr(internal_kv, "_internal_kv_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"\$UNSET_KV_SECRET is unset"):
        curve_keys("curve", "UNSET_KV_SECRET")


def test_auth_none_is_plaintext_said_loudly(caplog):
    assert curve_keys("none", ENV) is None
    assert "plaintext" in caplog.text


def kv_pool(**kv_events) -> dict:
    return {
        "name": "primary",
        "model": "m",
        "routing": {"policy": "kv_aware", "kv_events": kv_events},
    }


def test_a_libzmq_without_curve_fails_the_config_not_into_plaintext(monkeypatch):
    monkeypatch.setattr(models, "curve_available", lambda: False)
    with pytest.raises(ValueError, match=r"kv_events.auth: curve needs a libzmq built with CURVE"):
        PoolConfig.model_validate(kv_pool())
    # Said outright, plaintext is allowed (a laptop); and pools that publish no events need none.
    assert PoolConfig.model_validate(kv_pool(auth="none")).routing.kv_events.auth == "none"
    PoolConfig.model_validate({"name": "p", "model": "m", "routing": {"policy": "round_robin"}})


@pytest.mark.parametrize(
    ("field", "value"),
    [("auth", "tls"), ("curve_secret_env", "not a name"), ("max_message_bytes", 1024)],
)
def test_kv_events_settings_are_checked(field, value):
    with pytest.raises(ValueError, match=field):
        PoolConfig.model_validate(kv_pool(**{field: value}))


def test_curve_available_asks_libzmq():
    assert curve.curve_available() is bool(zmq.has("curve"))
