"""The admin API on the real graph: keys, the breaker board over its Serve handle, the schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import ADMIN_KEY, ALPHA_KEY, BREAKER_THRESHOLD
from tests.polling import eventually

pytestmark = pytest.mark.e2e


def test_admin_routes_take_an_admin_key_only(forge_url):
    for key, status in ((None, 401), ("sk-wrong", 401), (ALPHA_KEY, 403), (ADMIN_KEY, 200)):
        headers = {"authorization": f"Bearer {key}"} if key else {}
        answer = httpx.get(f"{forge_url}/admin/breakers", headers=headers, timeout=10)
        assert answer.status_code == status, answer.text
        if status != 200:
            assert set(answer.json()["error"]) >= {"message", "type", "code"}


def test_breakers_are_read_and_reset_through_the_board_deployment(forge_url, faults):
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    # The solo pool: one replica, no fallback, so its failures are never retried (other tests
    # count retries, and Ray's metrics export lags behind them).
    faults.set_all("pool-solo", {"mode": "error"})
    for _ in range(BREAKER_THRESHOLD + 1):  # each a 502; the pool's breaker opens
        httpx.post(
            f"{forge_url}/v1/chat/completions",
            json={"model": "forge-solo", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {ALPHA_KEY}"},
            timeout=30,
        )
    faults.set_all("pool-solo", None)

    def solo_state() -> str | None:
        states = httpx.get(f"{forge_url}/admin/breakers", headers=admin, timeout=10).json()
        return states.get("solo", {}).get("state")

    eventually(lambda: solo_state() == "open", timeout_s=10, what="the solo pool's breaker open")
    # As an operator runs it on a machine of the cluster: nothing of Ray's set beforehand.
    shown = _forge_breakers()
    assert shown["solo"]["state"] == "open" and shown["solo"]["adopted"] is False
    for typo in ({"backnd": "solo"}, {"backend": "nope"}):  # never "reset everything"
        refused = httpx.post(
            f"{forge_url}/admin/breakers/reset", json=typo, headers=admin, timeout=10
        )
        assert refused.status_code == 400, refused.text
    assert solo_state() == "open"
    reset = httpx.post(
        f"{forge_url}/admin/breakers/reset", json={"backend": "solo"}, headers=admin, timeout=10
    )
    assert reset.status_code == 200, reset.text
    # A closed breaker with no failures since is one the board no longer needs to list.
    assert reset.json().get("solo", {"state": "closed"})["state"] == "closed"
    assert solo_state() in (None, "closed")


def _forge_breakers() -> dict:
    import ray

    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    address = ray.get_runtime_context().gcs_address
    done = subprocess.run(
        [sys.executable, "-m", "serve_app.cli", "breakers", "--address", address],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_the_schema_lists_the_inference_and_admin_routes(forge_url):
    paths = httpx.get(f"{forge_url}/openapi.json", timeout=10).json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/usage"} <= set(paths)
    assert {"/admin/usage", "/admin/breakers", "/admin/breakers/reset"} <= set(paths)


def test_a_fault_injected_through_the_admin_api_reaches_the_pools_replicas(forge_url):
    """POST /admin/faults reaches every replica of the pool (a call pinned to each through the
    pool's router), what the eval gate's failover drill does. On the solo pool (no fallback, one
    replica): its failures are never retried, and other tests count retries."""
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}

    def fault(mode: str) -> dict:
        answer = httpx.post(
            f"{forge_url}/admin/faults",
            json={"pool": "solo", "fault": {"mode": mode}},
            headers=admin,
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        return answer.json()["replicas"]

    def status() -> int:
        return httpx.post(
            f"{forge_url}/v1/chat/completions",
            json={"model": "forge-solo", "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": f"Bearer {ALPHA_KEY}"},
            timeout=30,
        ).status_code

    try:
        replicas = fault("error")
        assert len(replicas) == 1 and all(f["mode"] == "error" for f in replicas.values())
        assert status() == 502
    finally:
        cleared = fault("none")
        httpx.post(  # one failure is below the breaker's threshold; leave nothing behind
            f"{forge_url}/admin/breakers/reset", json={"backend": "solo"}, headers=admin, timeout=10
        )
    assert all(f["mode"] == "none" for f in cleared.values())
    assert status() == 200
