"""One Ray instance and one Forge graph per test session, driven over real HTTP."""

from __future__ import annotations

import hashlib
import os
import socket
import time

import httpx
import pytest

APP = "forge"
ALPHA_KEY = "sk-test-alpha"
BETA_KEY = "sk-test-beta"
FALLBACK_KEY = "sk-test-upstream-secret"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def forge_args(port: int) -> dict:
    fast = {"prefill_base_s": 0.002, "decode_base_s": 0.004, "max_num_seqs": 32}
    return {
        "gateway": {
            "max_body_bytes": 64 * 1024,
            "deployment": {"ray_actor_options": {"num_cpus": 0}},
        },
        "tenants": [
            {"name": "alpha", "key_hashes": [_sha(ALPHA_KEY)]},
            {"name": "beta", "key_hashes": [_sha(BETA_KEY)]},
        ],
        "pools": [
            {
                "name": "primary",
                "model": "forge-sim",
                "engine": fast,
                "deployment": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}},
            },
            {
                # One replica, one slot, a queue of one, no fallback: for the failure statuses.
                "name": "solo",
                "model": "forge-solo",
                "engine": fast,
                "fallback": False,
                "first_token_timeout_s": 1.5,
                "deployment": {
                    "num_replicas": 1,
                    "max_ongoing_requests": 1,
                    "max_queued_requests": 1,
                    "ray_actor_options": {"num_cpus": 0},
                },
            },
        ],
        "fallback": {
            "base_url": f"http://127.0.0.1:{port}/mock/v1",
            "model": "mock-gemini",
            "api_key_env": "FORGE_TEST_FALLBACK_KEY",
        },
    }


@pytest.fixture(scope="session")
def forge_url():
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.mock_openai import build_mock

    os.environ["FORGE_TEST_FALLBACK_KEY"] = FALLBACK_KEY
    ray.init(
        num_cpus=2,
        object_store_memory=80 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"FORGE_TEST_FALLBACK_KEY": FALLBACK_KEY}},
    )
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_mock({"model": "mock-gemini", "api_key_env": "FORGE_TEST_FALLBACK_KEY"}),
        name="mock-fallback",
        route_prefix="/mock",
    )
    serve.run(build_app(forge_args(port)), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    yield url
    # No serve.shutdown(): direct-ingress replicas drain for 30 s; the session is over anyway.
    ray.shutdown()


@pytest.fixture
def openai_client(forge_url):
    import openai

    with openai.OpenAI(base_url=f"{forge_url}/v1", api_key=ALPHA_KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def faults(forge_url):
    """Set faults on replicas; every fault set in a test is cleared after it."""
    from serve_app import replica_admin

    touched: set[str] = set()

    class Faults:
        def set_all(self, deployment: str, spec: dict) -> list[str]:
            touched.add(deployment)
            return replica_admin.set_fault_all(APP, deployment, spec)

    yield Faults()
    for deployment in touched:
        replica_admin.set_fault_all(APP, deployment, None)
