"""The pool's slot budget holds across gateway replicas that keep freed slots parked."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from loadtest import fairness
from loadtest.http_load import closed_loop
from serve_app.replica import admin as replica_admin
from tests.e2e.conftest import APP, FAIR_TENANTS, tenant_key
from tests.polling import eventually

pytestmark = pytest.mark.e2e

BODY = {**fairness.BODY, "model": "forge-fair"}


def test_slots_in_flight_stay_within_max_inflight_across_gateway_replicas(forge_url):
    """Two gateway replicas, one tenant on each replica's own port. First each stays under its
    half of the pool's 8 slots, so nobody queues and each replica ends with slots parked; then
    both burst past the budget, taking their parked slots at once while the rest queue at the
    scheduler. Neither the pool's replica nor the scheduler ever holds more than 8 streams or
    leases at once (a variant that told the scheduler a parked slot was free served 16), and no
    slot is left held by a request once the load stops. (Streams, not the engine's running +
    waiting: like vLLM, the engine counts a finished sequence until its next step, when the
    gateway may rightly have reused its slot.)"""
    urls = replica_admin.direct_ingress_urls(APP) or [forge_url, forge_url]
    assert len(urls) == 2, urls
    pool = replica_admin.replica_ids(APP, "pool-fair")
    peak, stop = 0, threading.Event()

    def watch_the_engine() -> None:
        # Every sample, the pool replica's open streams and the scheduler's leases. (It was
        # once bounded on two samples in a row: a single one read 9 now and then, the scheduler
        # holding 9 leases while its ``sync`` ran in Serve's thread pool beside ``acquire``.)
        nonlocal peak
        while not stop.is_set():
            streams = sum(replica_admin.stats(APP, "pool-fair", r)["open_streams"] for r in pool)
            leases = replica_admin.scheduler_snapshot(APP, "fair")["slots_used"]
            peak = max(peak, streams, leases)
            time.sleep(0.01)

    def phase(concurrency: int, duration_s: float):
        return [
            closed_loop(
                f"{url}/v1/chat/completions",
                BODY,
                concurrency=concurrency,
                duration_s=duration_s,
                api_key=tenant_key(tenant),
                pause_after_refusal_s=0.1,
            )
            for url, tenant in zip(urls, FAIR_TENANTS, strict=True)
        ]

    async def load():
        calm = await asyncio.gather(*phase(concurrency=4, duration_s=3))
        burst = await asyncio.gather(*phase(concurrency=10, duration_s=4))
        return [*calm, *burst]

    watcher = threading.Thread(target=watch_the_engine, daemon=True)
    watcher.start()
    try:
        runs = asyncio.run(load())
    finally:
        stop.set()
        watcher.join(timeout=10)
    ok = sum(run.summary()["ok"] for run in runs)
    assert ok > 40, [run.summary() for run in runs]
    assert 0 < peak <= 8, f"the pool held {peak} streams or leases at once; its budget is 8"

    def no_slot_held_by_a_request() -> bool:
        snap = replica_admin.scheduler_snapshot(APP, "fair")
        return snap["slots_used"] == snap["parked"] and not any(snap["inflight"].values())

    eventually(no_slot_held_by_a_request, timeout_s=10, what="every request's slot back")
