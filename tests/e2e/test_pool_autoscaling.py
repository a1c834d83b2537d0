"""An autoscaled pool under Serve's own controller: a gateway's feed, one more call open on the
replica it streams from, starts no replica; a request past the target does.

Its own two small applications (``/scaling`` and its pool's), so the session's graph is left
alone. The gateway's handle and the pool's replica report to the controller every 0.5 s rather
than Serve's 10 s (``metrics_interval_s``), so that the drill takes seconds; the decisions are
the controller's."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from tests.e2e.conftest import ALPHA_KEY, front_of_pool_app
from tests.polling import eventually

# A scaling drill (~20 s and a second replica started, after ~10 s to deploy): in the slow run.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GATEWAY_APP = "forge-scaling"
POOL_APP = "forge-scaling-pool"
MODEL = "forge-scaling"
POOL_DEPLOYMENT = "pool-scaling"
# Long enough that Serve's own policy would have added the replica for the feed twice over (it
# needs a report and the upscale delay; with Forge's policy taken out, it did in seconds).
HOLD_S = 8.0


def pool_args() -> dict:
    return {
        "pool": {
            "name": "scaling",
            "model": MODEL,
            # Every answer ~30 s long.
            "engine": {
                "decode_base_s": 0.05,
                "output_tokens_min": 600,
                "output_tokens_max": 600,
                "max_num_seqs": 8,
            },
            "fallback": False,
            "deployment": {
                "autoscaling_config": {
                    "min_replicas": 1,
                    "initial_replicas": 1,
                    "max_replicas": 2,
                    "target_ongoing_requests": 2,
                    # Deprecated in favour of environment variables, but what Serve 2.60 reads
                    # for both pushes (its router's and its replica's).
                    "metrics_interval_s": 0.5,
                    "look_back_period_s": 1,
                    # A decision must hold this long: a report of the feed from the gateway's
                    # handle a moment before the replica's is not one.
                    "upscale_delay_s": 3,
                    "downscale_delay_s": 600,
                },
                "ray_actor_options": {"num_cpus": 0},
            },
        }
    }


def gateway_args() -> dict:
    return front_of_pool_app("scaling", MODEL, POOL_APP)


async def hold_stream(client: httpx.AsyncClient, started: asyncio.Event) -> None:
    """One long stream (~30 s), read until cancelled."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long answer"}],
        "max_tokens": 600,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    async with client.stream(
        "POST", "/scaling/v1/chat/completions", json=body, headers=headers
    ) as response:
        assert response.status_code == 200, await response.aread()
        async for _ in response.aiter_bytes():
            started.set()


async def until(condition, timeout_s: float, what: str) -> None:
    """``eventually`` off the loop: the conditions ask Ray, and the streams read meanwhile."""
    await asyncio.to_thread(eventually, condition, timeout_s=timeout_s, what=what, interval_s=0.2)


async def test_a_pools_feeds_start_no_replica_and_its_requests_past_the_target_do(forge_url):
    from ray import serve

    from serve_app.app import build_app, build_pool
    from serve_app.replica import admin as replica_admin

    def replicas() -> list[str]:
        return replica_admin.replica_ids(POOL_APP, POOL_DEPLOYMENT)

    await asyncio.to_thread(serve.run, build_pool(pool_args()), name=POOL_APP, route_prefix=None)
    await asyncio.to_thread(
        serve.run, build_app(gateway_args()), name=GATEWAY_APP, route_prefix="/scaling"
    )
    streams: list[asyncio.Task] = []

    async def start_stream(client: httpx.AsyncClient) -> None:
        started = asyncio.Event()
        streams.append(asyncio.create_task(hold_stream(client, started)))
        await asyncio.wait_for(started.wait(), 30)

    def open_feeds() -> int:
        return replica_admin.stats(POOL_APP, POOL_DEPLOYMENT, replica)["open_feeds"]

    try:
        assert len(replicas()) == 1
        (replica,) = replicas()
        async with httpx.AsyncClient(base_url=forge_url, timeout=60) as client:
            # Two requests, the target. The first opens the gateway's feed; the second, sent
            # at once, streams over it and so keeps it open (an unused feed ends after 1 s).
            # Serve's own policy counts three and adds a replica.
            await start_stream(client)
            await start_stream(client)
            await until(lambda: open_feeds() == 1, 10, "the gateway's feed to open")
            for _ in range(int(HOLD_S / 0.5)):
                await asyncio.sleep(0.5)
                assert replicas() == [replica], "a replica was started for the feed"
                assert open_feeds() == 1 and not any(task.done() for task in streams)

            # A third request: past the target, so a second replica.
            await start_stream(client)
            await until(lambda: len(replicas()) == 2, 30, "a second replica for the third request")
    finally:
        for task in streams:
            task.cancel()
        for task in streams:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        serve.delete(GATEWAY_APP, _blocking=False)
        serve.delete(POOL_APP, _blocking=False)
