"""Least queue: (waiting, running + in_flight, kv_cache_usage, id), from the replicas' reports."""

from __future__ import annotations

from serve_app.routing import LeastQueuePolicy, ReplicaView, RouteRequest

REQUEST = RouteRequest(())


def test_waiting_dominates() -> None:
    replicas = [
        ReplicaView("busy", in_flight=6, running=8, waiting=0, kv_cache_usage=0.9),
        ReplicaView("queued", in_flight=0, running=1, waiting=1),
    ]
    assert LeastQueuePolicy().rank(replicas, REQUEST) == ["busy", "queued"]


def test_then_running_plus_in_flight_then_kv_usage_then_id() -> None:
    replicas = [
        ReplicaView("a", in_flight=2, running=3, kv_cache_usage=0.1),  # 5
        ReplicaView("b", in_flight=0, running=4, kv_cache_usage=0.5),  # 4, fuller cache
        ReplicaView("c", in_flight=4, running=0, kv_cache_usage=0.2),  # 4
        ReplicaView("e", in_flight=1, running=3, kv_cache_usage=0.2),  # 4, same as c
    ]
    assert LeastQueuePolicy().rank(replicas, REQUEST) == ["c", "e", "b", "a"]


def test_excluded_replicas_never_appear() -> None:
    replicas = [
        ReplicaView("idle", in_flight=0, excluded=True),
        ReplicaView("busy", in_flight=3, waiting=4),
    ]
    assert LeastQueuePolicy().rank(replicas, REQUEST) == ["busy"]
    assert LeastQueuePolicy().rank(replicas[:1], REQUEST) == []
