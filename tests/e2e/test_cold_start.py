"""A pool scaled to zero: the fallback serves at once, one call wakes the pool, and traffic
comes home through the pool breaker's half-open probe once a replica is up."""

from __future__ import annotations

import time

import httpx
import pytest

from serve_app.replica import admin as replica_admin
from tests.e2e.conftest import ALPHA_KEY, APP, COLD_POOL

pytestmark = pytest.mark.e2e

AUTH = {"authorization": f"Bearer {ALPHA_KEY}"}
BODY = {"model": "forge-cold", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_cold_pool_is_served_by_the_fallback_while_it_wakes_then_traffic_comes_home(
    forge_url,
):
    assert replica_admin.replica_ids(APP, f"pool-{COLD_POOL}") == []
    served, waits = [], []
    first_sent = time.monotonic()
    deadline = first_sent + 90
    while time.monotonic() < deadline:
        started = time.monotonic()
        response = httpx.post(f"{forge_url}/v1/chat/completions", json=BODY, headers=AUTH)
        waits.append(time.monotonic() - started)
        assert response.status_code == 200, response.text
        served.append(response.headers["x-forge-backend"])
        if served[-1] == COLD_POOL:
            break
        time.sleep(0.2)
    assert served[0] == "fallback", "the first request did not wait for a replica"
    assert served[-1] == COLD_POOL, f"the pool never came home: {served}"
    # No request waited for the replica to start (a cold GPU replica takes minutes): each was
    # answered in a fraction of the time the pool took to come home. A request that waited for
    # the replica would take about all of it. (Measured against the start, not a fixed number
    # of seconds: on a loaded machine an answer from the fallback took 3.8 s.)
    came_home_s = time.monotonic() - first_sent
    assert max(waits[:-1]) < came_home_s / 2, (waits, came_home_s)
    assert len(replica_admin.replica_ids(APP, f"pool-{COLD_POOL}")) == 1  # one warm-up, not N
    breaker = replica_admin.describe_breakers(APP)[COLD_POOL]
    deadline = time.monotonic() + 5  # the probe's verdict reaches the board right after it
    while breaker["state"] != "closed" and time.monotonic() < deadline:
        time.sleep(0.1)
        breaker = replica_admin.describe_breakers(APP)[COLD_POOL]
    assert breaker["state"] == "closed"
    assert breaker["probes_per_half_open"][-1] == 1, breaker  # home through exactly one probe
