"""The bridge between a gateway replica and its pools' routers: one per (application, pool),
each isolated from the others, forgotten together by ``reset_bridges``."""

from __future__ import annotations

import pytest

from serve_app.bridge import _MAX_ROUTED, PoolBridge, pool_bridge, replica_backend, reset_bridges


@pytest.fixture(autouse=True)
def fresh_bridges():
    reset_bridges()
    yield
    reset_bridges()


def test_each_app_and_pool_has_one_bridge_of_its_own():
    # Either side may ask first (the gateway or the router Serve builds): both get the same one.
    assert pool_bridge("forge", "primary") is pool_bridge("forge", "primary")

    primary = pool_bridge("forge", "primary")
    primary.replica_ids = frozenset({"a", "b"})
    primary.avoid["req-1"] = "a"
    primary.note_routed("req-1", "b", probe=False)

    # Another pool of the same app, and the same pool of another app, see none of it.
    for other in (pool_bridge("forge", "secondary"), pool_bridge("forge-2", "primary")):
        assert other is not primary
        assert other.replica_ids is None
        assert other.avoid == {} and other.routed == {}
        assert other.take_routed("req-1") is None

    assert primary.take_routed("req-1") == ("b", False)


def test_reset_bridges_forgets_every_bridge():
    old = pool_bridge("forge", "primary")
    old.replica_ids = frozenset({"a"})
    old.breakers = object()  # what a gateway installs

    reset_bridges()

    new = pool_bridge("forge", "primary")
    assert new is not old
    assert new.replica_ids is None and new.breakers is None


def test_a_route_is_handed_over_once_and_drops_the_retrys_avoid_note():
    bridge = PoolBridge()
    bridge.note_routed("req-1", "a", probe=False)
    bridge.note_routed("req-2", "b", probe=True)
    bridge.avoid["req-1"] = "c"  # its first attempt failed on c; the retry went to a

    assert bridge.take_routed("req-1") == ("a", False)
    assert "req-1" not in bridge.avoid
    assert bridge.take_routed("req-1") is None  # once

    assert bridge.take_routed("req-2") == ("b", True)  # the probe flag travels with it


def test_taking_a_route_never_noted_still_drops_the_avoid_note():
    """A retry cancelled before Serve routed it leaves no route, and must leave no note."""
    bridge = PoolBridge()
    bridge.avoid["req-1"] = "a"
    assert bridge.take_routed("req-1") is None
    assert bridge.avoid == {}


def test_the_routed_map_is_bounded():
    """Routes nobody collects (callers cancelled before the gateway asked) cannot pile up."""
    bridge = PoolBridge()
    for i in range(_MAX_ROUTED + 100):
        bridge.note_routed(f"req-{i}", "a", probe=False)
        assert len(bridge.routed) <= _MAX_ROUTED
    # The latest route is always there to be taken.
    last = f"req-{_MAX_ROUTED + 99}"
    assert bridge.take_routed(last) == ("a", False)


def test_a_replicas_breaker_is_named_by_pool_and_replica():
    assert replica_backend("primary", "abc123") == "primary/abc123"
    assert replica_backend("primary", "abc123") != replica_backend("secondary", "abc123")
