"""Prefix-aware routing through the real gateway: a prompt prefix finds its warm replica."""

from __future__ import annotations

import pytest

from serve_app.replica import admin as replica_admin
from tests.e2e.conftest import APP
from tests.polling import eventually

pytestmark = pytest.mark.e2e

# ~150 tokens: several full 16-token blocks shared by every request below.
SYSTEM = " ".join(f"rule {i}: answer briefly and cite the handbook section {i}." for i in range(15))


def _ask(client, model: str, question: str) -> str:
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
    )
    return raw.headers["x-forge-replica"]


def _hits(deployment: str, replica: str) -> int:
    return replica_admin.stats(APP, deployment, replica)["prefix_cache_hits"]


_REPORTED = ("prefix_cache_queries", "num_requests_running", "num_requests_waiting")


def _last_report(metric, replica: str) -> dict[str, float]:
    """Part of ``replica``'s last routing-stats report, as its gauges export it: a replica sets
    them in the very call in which Serve's controller pulls the report, and the controller
    pushes a changed report to every router as it gets it."""
    return {name: metric(f"forge_engine_{name}", f'replica="{replica}"') for name in _REPORTED}


def _warm_and_idle(report: dict[str, float]) -> bool:
    """Taken after the first request was done: its prefix cache was queried (so the prompt's
    blocks are in the report), and nothing runs or waits."""
    busy = report["num_requests_running"] or report["num_requests_waiting"]
    return report["prefix_cache_queries"] > 0 and not busy


def _await_warm_and_idle(metric, replica: str, showing: str) -> None:
    eventually(
        lambda: _warm_and_idle(_last_report(metric, replica)),
        timeout_s=10,
        interval_s=0.2,
        what=f"a routing-stats report of {replica} {showing}, idle",
        explain=lambda: _last_report(metric, replica),
    )


@pytest.mark.parametrize("policy", ["prefix-affinity", "kv-aware"])
def test_a_shared_prefix_lands_on_the_replica_that_caches_it(openai_client, metric, policy):
    deployment, model = f"pool-{policy}", f"forge-{policy}"
    first = _ask(openai_client, model, "what is rule 3?")
    # Routers read replicas' reports (every 0.2 s): kv_aware finds the prefix in them, and both
    # policies read a replica's load there (a report from mid-request shows the warm replica
    # busy, and a busy warm replica can lose to an idle cold one).
    _await_warm_and_idle(metric, first, f"({policy}) showing its prefix cached")
    hits_before = _hits(deployment, first)
    followers = {_ask(openai_client, model, f"and rule {i}?") for i in range(4)}
    assert followers == {first}, "every request with the prefix went to the warm replica"
    assert _hits(deployment, first) - hits_before >= 4 * 16 * 4, "and hit its prefix cache"


def test_kv_aware_routers_follow_the_replicas_kv_events(openai_client, metric):
    """The kv-aware pool's routers hold, from the replicas' events, the blocks a new prompt
    left in the cache it was routed to: the index grows by at least the prompt's full blocks."""
    pool = 'pool="kv-aware"'
    events, blocks = metric("forge_kv_events_total", pool), metric("forge_kv_index_blocks", pool)
    replica = _ask(openai_client, "forge-kv-aware", f"a prompt no replica has seen {SYSTEM[::-1]}")
    target = f'target="{replica}"'
    # The prompt is over 10 full blocks, all new (the cache is far from full: nothing evicted).
    eventually(
        lambda: (
            metric("forge_kv_events_total", pool) > events
            and metric("forge_kv_index_blocks", pool, target) >= 10
            and metric("forge_kv_index_blocks", pool) >= blocks + 10
        ),
        timeout_s=15,
        interval_s=0.5,
        what="the kv-aware routers to apply the replica's events and index its new blocks",
        explain=lambda: {
            "events": metric("forge_kv_events_total", pool),
            "blocks": metric("forge_kv_index_blocks", pool, target),
            "lag observations": metric("forge_kv_event_lag_seconds_count", pool),
        },
    )


def test_kv_events_reach_only_holders_of_the_clusters_key(openai_client):
    """The kv-aware pool's replicas publish over CURVE with the key made for this Ray cluster
    (no ``FORGE_KV_CURVE_SECRET`` here, so the one kept in its GCS): a subscriber with that key
    hears them (a heartbeat a second at least); one without it hears nothing, and its snapshot
    request goes unanswered."""
    import ray
    import zmq
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    from serve_app.config.models import KvEventsConfig
    from serve_app.kvcache.curve import connect_curve, curve_keys

    serve_controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    running = ray.get(serve_controller._all_running_replicas.remote(), timeout=30)
    where = next(
        replica.routing_stats["kv_events"]
        for deployment_id, replicas in running.items()
        if deployment_id.app_name == APP and deployment_id.name == "pool-kv-aware"
        for replica in replicas
        if (replica.routing_stats or {}).get("kv_events")
    )
    config = KvEventsConfig()
    keys = curve_keys(config.auth, config.curve_secret_env)  # this driver is in the cluster too
    ctx = zmq.Context()
    try:
        keyed, plain = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
        connect_curve(keyed, keys)
        stranger = ctx.socket(zmq.DEALER)
        for sock in (keyed, plain, stranger):
            sock.setsockopt(zmq.LINGER, 0)
        for sock in (keyed, plain):
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(where["endpoint"])
        stranger.connect(where["snapshot"])
        stranger.send(b"snapshot")
        assert keyed.poll(15_000), "a subscriber with the cluster's key hears the replica"
        assert not plain.poll(2_000), "one without it hears nothing"
        assert not stranger.poll(0), "and gets no snapshot"
    finally:
        ctx.destroy(linger=0)


def test_a_conversations_follow_up_goes_to_the_replica_that_holds_it(openai_client, metric):
    """``previous_response_id`` puts the whole conversation before the new input, so on a
    prefix-aware pool the follow-up lands where the opening turn's prompt is cached."""
    model = "forge-prefix-affinity"
    opening = openai_client.responses.with_raw_response.create(
        model=model,
        input=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "rule 3?"}],
        max_output_tokens=2,
    )
    first, opened = opening.headers["x-forge-replica"], opening.parse().id
    _await_warm_and_idle(metric, first, "showing the conversation cached")
    followers = {
        openai_client.responses.with_raw_response.create(
            model=model, previous_response_id=opened, input=f"and rule {i}?", max_output_tokens=2
        ).headers["x-forge-replica"]
        for i in range(3)
    }
    assert followers == {first}
