"""A gateway replica that starts while Serve's target configuration is bad starts from what a
running replica serves, and says so, instead of failing its start again and again.

Its own two small applications (``/live`` and its pool's), so the session's graph is left
alone. The bad change rides in the gateway's deployment options (``user_config`` in its
args), so Serve replaces every gateway replica, one at a time: each new one starts on the bad
target while an older one still runs, which is the case of a scale-up or a replacement while
a refused ``user_config`` is the target."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest
from ray import serve

from serve_app.app import build_app, build_pool
from serve_app.replica import admin as replica_admin
from tests.e2e.conftest import ADMIN_KEY, ALPHA_KEY, LEDGER_PATH

# Two gateway replicas rolled one after the other (~30 s of the graph's CPU): the slow run.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GATEWAY_APP = "forge-live"
POOL_APP = "forge-live-pool"
MODEL = "forge-live"
ALPHA = {"name": "alpha", "key_hashes": [hashlib.sha256(ALPHA_KEY.encode()).hexdigest()]}
GOOD = {"tenants": [{**ALPHA, "weight": 2}]}
BAD = {"tenants": [{**ALPHA, "weight": -1}]}


def pool_args() -> dict:
    return {
        "pool": {
            "name": "live",
            "model": MODEL,
            "engine": {"decode_base_s": 0.002, "max_num_seqs": 8},
            "fallback": False,
            "routing": {"policy": "least_in_flight", "stats_period_s": 0.2},
            "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
        }
    }


def gateway_args(user_config: dict, redis_url: str) -> dict:
    return {
        "metering": {"sqlite_path": LEDGER_PATH},
        "store": {"redis_url": redis_url, "key_prefix": "forge-live:"},  # two replicas share it
        "tenants": [ALPHA],
        "admin": {"key_hashes": [hashlib.sha256(ADMIN_KEY.encode()).hexdigest()]},
        "pools": [{"name": "live", "model": MODEL, "app": POOL_APP, "fallback": False}],
        "gateway": {
            "deployment": {
                "num_replicas": 2,
                "ray_actor_options": {"num_cpus": 0},
                "user_config": user_config,
            }
        },
    }


async def test_replicas_started_on_a_bad_target_serve_what_the_running_ones_serve(
    forge_url, redis_server
):
    if redis_server is None:
        pytest.skip("two gateway replicas need a shared store: no redis-server here")

    def deploy(user_config: dict) -> None:
        app = build_app(gateway_args(user_config, redis_server.url))
        serve.run(app, name=GATEWAY_APP, route_prefix="/live")

    await asyncio.to_thread(serve.run, build_pool(pool_args()), name=POOL_APP, route_prefix=None)
    await asyncio.to_thread(deploy, GOOD)
    before = set(replica_admin.replica_ids(GATEWAY_APP, "gateway"))
    try:
        await asyncio.to_thread(deploy, BAD)  # Serve's deploy succeeds: every replica started
        after = set(replica_admin.replica_ids(GATEWAY_APP, "gateway"))
        assert len(after) == 2 and not after & before, (before, after)
        admin = {"authorization": f"Bearer {ADMIN_KEY}"}
        # Each replica on its own port (direct ingress, routed by the full path as HAProxy
        # sends it) where the session has it, else through the proxy a few times.
        ports = replica_admin.direct_ingress_urls(GATEWAY_APP)
        fronts = [f"{url}/live" for url in ports] or [f"{forge_url}/live"] * 6
        assert len(fronts) in (2, 6), fronts
        for front in fronts:
            async with httpx.AsyncClient(base_url=front, timeout=30) as client:
                config = (await client.get("/admin/status", headers=admin)).json()["config"]
                assert (config["refused"] or {}).get("started_from") == "a running replica", config
                assert "weight" in config["refused"]["error"]
                assert (await client.get("/readyz")).json()["config"] == "refused"
                answer = await client.post(
                    "/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                    headers={"authorization": f"Bearer {ALPHA_KEY}"},
                )
                assert answer.status_code == 200, answer.text
    finally:
        serve.delete(GATEWAY_APP, _blocking=False)
        serve.delete(POOL_APP, _blocking=False)
