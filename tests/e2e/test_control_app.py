"""The schedulers and the breaker board in a control application of their own outlive a change
to the gateway's application (issue 30, item 7).

Serve replaces every deployment of an application whose args change. With the schedulers in the
gateway's application, a gateway change replaced them: the new scheduler knew none of the old
gateways' streams, so the pool was admitted up to twice its ``max_inflight`` until they drained,
and every open breaker closed. Here the gateway's args change while two streams hold the pool's
two slots: the scheduler and the board are the same replicas afterwards, the streams' slots are
still counted, a third request is refused (not admitted past the budget), and a breaker opened
before is still open.

Its own three small applications (``/ctl``, its pool's and its control's), so the session's graph
is left alone.
"""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import pytest

from tests.e2e.conftest import ALPHA_KEY, LEDGER_PATH
from tests.polling import eventually_async

# A rollout drill (a gateway replaced, draining): in the slow run, as test_pool_app.py.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GATEWAY_APP = "forge-ctl"
POOL_APP = "forge-ctl-pool"
CONTROL_APP = "forge-ctl-control"
MODEL = "forge-ctl"
HEADERS = {"authorization": f"Bearer {ALPHA_KEY}"}


def pool_args() -> dict:
    return {
        "pool": {
            "name": "ctl",
            "model": MODEL,
            # ~0.05 s a token: a 2,000-token stream outlasts the gateway's replacement (~30 s:
            # a direct-ingress replica is held that long).
            "engine": {"decode_base_s": 0.05, "max_num_seqs": 4},
            "fallback": False,
            "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
        }
    }


def gateway_args(max_body_bytes: int) -> dict:
    return {
        "metering": {"sqlite_path": LEDGER_PATH},
        "tenants": [
            {"name": "alpha", "key_hashes": [hashlib.sha256(ALPHA_KEY.encode()).hexdigest()]}
        ],
        "pools": [
            {
                "name": "ctl",
                "model": MODEL,
                "app": POOL_APP,
                "fallback": False,
                # Two slots; a short wait, so a request past the budget is a quick 429. Leases
                # renewed every second (a third of the TTL) while the streams run.
                "admission": {
                    "max_inflight": 2,
                    "deadline_s": 1,
                    "lease_ttl_s": 3,
                    "keep_warm_s": 0,
                },
            }
        ],
        "control_app": CONTROL_APP,
        "gateway": {
            "max_body_bytes": max_body_bytes,  # the change: one setting of the gateway's args
            "deployment": {"ray_actor_options": {"num_cpus": 0}},
        },
    }


async def stream(client: httpx.AsyncClient, started: asyncio.Event) -> int:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long answer"}],
        "max_tokens": 2000,
        "ignore_eos": True,  # vLLM's: the simulated model too runs to max_tokens
        "stream": True,
    }
    frames = 0
    async with client.stream(
        "POST", "/ctl/v1/chat/completions", json=body, headers=HEADERS
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                frames += 1
                started.set()
    return frames


def rolled() -> bool:
    from ray import serve

    deployment = serve.status().applications[GATEWAY_APP].deployments["gateway"]
    states = {str(state): n for state, n in deployment.replica_states.items()}
    return states.get("RUNNING", 0) >= 1 and states.get("STOPPING", 0) >= 1


async def test_a_gateway_change_keeps_the_slot_budget_and_the_open_breakers(forge_url):
    from ray import serve

    from serve_app.app import build_app, build_control, build_pool
    from serve_app.replica import admin as replica_admin

    await asyncio.to_thread(
        serve.run, build_control({"schedulers": ["ctl"]}), name=CONTROL_APP, route_prefix=None
    )
    await asyncio.to_thread(serve.run, build_pool(pool_args()), name=POOL_APP, route_prefix=None)
    await asyncio.to_thread(
        serve.run, build_app(gateway_args(1 << 20)), name=GATEWAY_APP, route_prefix="/ctl"
    )
    scheduler = replica_admin.replica_ids(CONTROL_APP, "scheduler-ctl")
    board = replica_admin.replica_ids(CONTROL_APP, "breaker-board")
    gateway = replica_admin.replica_ids(GATEWAY_APP, "gateway")
    try:
        # A breaker open on the board (a backend this graph does not send to, so the drill's
        # own requests are not routed around it).
        replica_admin._board(CONTROL_APP, "sync", [("elsewhere", "trip", False, 1)])
        async with httpx.AsyncClient(base_url=forge_url, timeout=60) as client:
            started = [asyncio.Event(), asyncio.Event()]
            streams = [asyncio.create_task(stream(client, s)) for s in started]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)

            # The gateway's args change: Serve replaces the gateway; the old one drains its
            # two streams, still holding their slots. (serve.run would wait for the drain.)
            serve._run(
                build_app(gateway_args((1 << 20) + 1024)),
                name=GATEWAY_APP,
                route_prefix="/ctl",
                _blocking=False,
            )
            await eventually_async(
                rolled,
                timeout_s=120,
                what="a new gateway running, the old one draining",
                interval_s=0.5,  # a controller call each time
            )
            assert set(replica_admin.replica_ids(GATEWAY_APP, "gateway")) - set(gateway)
            ended = [
                s.result() if not s.exception() else repr(s.exception())
                for s in streams
                if s.done()
            ]
            assert not ended, f"the streams ended before the change: {ended}"

            # The same scheduler and board, the streams' slots still counted: a third request
            # through the new gateway waits its second and is refused, not run past the budget.
            assert replica_admin.replica_ids(CONTROL_APP, "scheduler-ctl") == scheduler
            assert replica_admin.replica_ids(CONTROL_APP, "breaker-board") == board
            snapshot = replica_admin.scheduler_snapshot(CONTROL_APP, "ctl")
            assert snapshot["slots_used"] == 2, snapshot
            third = await client.post(
                "/ctl/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                headers=HEADERS,
            )
            assert third.status_code == 429, third.text
            assert third.json()["error"]["type"] == "capacity"  # the pool's, not a budget
            assert replica_admin.describe_breakers(CONTROL_APP)["elsewhere"]["state"] == "open"

            for task in streams:  # the clients leave: the old gateway gives their slots back
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)

        def released() -> bool:
            return replica_admin.scheduler_snapshot(CONTROL_APP, "ctl")["slots_used"] == 0

        await eventually_async(
            released, timeout_s=20, what="the streams' slots released", interval_s=0.5
        )
    finally:
        for app in (GATEWAY_APP, POOL_APP, CONTROL_APP):
            serve.delete(app, _blocking=False)
