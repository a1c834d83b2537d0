"""The pool's slot budget holds across gateway replicas that keep freed slots parked."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from loadtest import fairness
from loadtest.http_load import closed_loop
from serve_app import replica_admin
from tests.e2e.conftest import APP, FAIR_TENANTS, tenant_key
from tests.polling import eventually

pytestmark = pytest.mark.e2e

BODY = {**fairness.BODY, "model": "forge-fair"}


def test_slots_in_flight_stay_within_max_inflight_across_gateway_replicas(forge_url):
    """Two gateway replicas, each driven on its own port past the pool's 8 slots, each keeping
    freed slots parked for its next request: the pool's replica never runs more than 8, and no
    slot is left held by a request once the load stops."""
    urls = replica_admin.direct_ingress_urls(APP) or [forge_url]
    assert len(urls) == 2 or urls == [forge_url], urls
    pool = replica_admin.replica_ids(APP, "pool-fair")
    peak, stop = 0, threading.Event()

    def watch_the_engine() -> None:
        nonlocal peak
        while not stop.is_set():
            for replica in pool:
                stats = replica_admin.stats(APP, "pool-fair", replica)
                peak = max(peak, stats["num_requests_running"] + stats["num_requests_waiting"])
            time.sleep(0.01)

    async def load():
        return await asyncio.gather(
            *(
                closed_loop(
                    f"{url}/v1/chat/completions",
                    BODY,
                    concurrency=6,
                    duration_s=5,
                    api_key=tenant_key(tenant),
                    pause_after_refusal_s=0.1,
                )
                for url in urls * (2 if len(urls) == 1 else 1)
                for tenant in FAIR_TENANTS
            )
        )

    watcher = threading.Thread(target=watch_the_engine, daemon=True)
    watcher.start()
    try:
        runs = asyncio.run(load())
    finally:
        stop.set()
        watcher.join(timeout=10)
    ok = sum(run.summary()["ok"] for run in runs)
    assert ok > 40, [run.summary() for run in runs]
    assert 0 < peak <= 8, f"the pool ran {peak} requests at once; its budget is 8"

    def no_slot_held_by_a_request() -> bool:
        snap = replica_admin.scheduler_snapshot(APP, "fair")
        return snap["slots_used"] == snap["parked"] and not any(snap["inflight"].values())

    eventually(no_slot_held_by_a_request, timeout_s=10, what="every request's slot back")
