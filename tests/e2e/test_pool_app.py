"""A pool in a Serve application of its own rolls alone: the gateway keeps its replica, finds
the pool's new replicas by name, and its cache follows the engine the pool now runs.

Its own two small applications (``/split`` and its pool's), so the session's graph is left
alone. The change is an engine setting in the pool application's args: Serve versions every
deployment of an application by its args, so in one application this replaced the gateway too
(``tests/e2e/test_drain.py``)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.conftest import ALPHA_KEY, front_of_pool_app

# In the default run, not the slow one: in the slow run's session it ran just before the
# fair-admission drill, whose light tenant then measured 1.9x its baseline (1.4x without it).
# A rollout drill (~40 s of the graph's CPU): in the slow run, beside what it would slow.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GATEWAY_APP = "forge-split"
POOL_APP = "forge-split-pool"
MODEL = "forge-split"


def pool_args(decode_s: float) -> dict:
    return {
        "pool": {
            "name": "split",
            "model": MODEL,
            "engine": {"decode_base_s": decode_s, "max_num_seqs": 8},
            "fallback": False,
            "routing": {"policy": "least_in_flight", "stats_period_s": 0.2},
            "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
        }
    }


def gateway_args() -> dict:
    return front_of_pool_app("split", MODEL, POOL_APP)


async def cache_results(client: httpx.AsyncClient, until: str, within_s: float = 20) -> list[str]:
    """The same temperature-0 request again and again until it is served ``until``."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "the same question"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    seen: list[str] = []
    deadline = asyncio.get_running_loop().time() + within_s
    while asyncio.get_running_loop().time() < deadline:
        response = await client.post("/split/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        seen.append(response.headers["x-forge-cache"])
        if seen[-1] == until:
            return seen
        await asyncio.sleep(0.2)
    raise AssertionError(f"never {until!r}: {seen}")


async def test_a_pool_in_its_own_application_rolls_without_the_gateway(forge_url):
    from ray import serve

    from serve_app.app import build_app, build_pool
    from serve_app.replica import admin as replica_admin

    def deploy_pool(decode_s: float) -> None:
        serve.run(build_pool(pool_args(decode_s)), name=POOL_APP, route_prefix=None)

    await asyncio.to_thread(deploy_pool, 0.002)
    await asyncio.to_thread(
        serve.run, build_app(gateway_args()), name=GATEWAY_APP, route_prefix="/split"
    )
    gateway = replica_admin.replica_ids(GATEWAY_APP, "gateway")
    pool = replica_admin.replica_ids(POOL_APP, "pool-split")
    try:
        # The application's do-nothing ingress runs no process, yet the application is up.
        assert replica_admin.replica_ids(POOL_APP, "ingress") == []
        assert serve.status().applications[POOL_APP].status == "RUNNING"
        async with httpx.AsyncClient(base_url=forge_url, timeout=30) as client:
            # Served through the handle found by name; kept and replayed once the pool's
            # replicas have said what they run.
            before = await cache_results(client, until="hit")
            assert "miss" in before

            await asyncio.to_thread(deploy_pool, 0.003)  # the roll: the pool's args only
            assert set(replica_admin.replica_ids(POOL_APP, "pool-split")) - set(pool)
            after = await cache_results(client, until="hit")
        # Another engine: the old one's answer is not replayed; the new one's is kept.
        assert "miss" in after and after.index("miss") < after.index("hit"), after
        assert replica_admin.replica_ids(GATEWAY_APP, "gateway") == gateway  # not replaced
        # An operator's call to the ingress is answered: Serve wakes a replica for it. (After
        # the roll: a running ingress would be replaced by it too, and change its timing.)
        described = serve.get_app_handle(POOL_APP).describe.remote()
        assert (await asyncio.wait_for(described, 60))["pool"] == "split"
    finally:
        serve.delete(GATEWAY_APP, _blocking=False)  # they drain on their own time
        serve.delete(POOL_APP, _blocking=False)
