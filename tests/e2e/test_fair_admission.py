"""A flooding tenant sheds itself while a light tenant keeps its latency (fair admission)."""

from __future__ import annotations

import asyncio

import pytest

from loadtest import fairness
from loadtest.http_load import closed_loop
from serve_app import replica_admin
from tests.e2e.conftest import APP, tenant_key

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The drill's request (loadtest/fairness.py), sent to the test graph's fair-admission pool.
BODY = {**fairness.BODY, "model": "forge-fair"}


def _light(url: str, duration_s: float):
    return closed_loop(url, BODY, concurrency=2, duration_s=duration_s, api_key=tenant_key("light"))


def test_flooder_sheds_alone_while_light_tenant_keeps_its_latency(forge_url):
    # Direct ingress where it is on: on 2 cores the proxy hop's CPU would be what we measure.
    base = replica_admin.direct_ingress_url(APP) or forge_url
    url = f"{base}/v1/chat/completions"

    async def solo():
        return await _light(url, 6)

    async def contended():
        flood = closed_loop(
            url,
            BODY,
            concurrency=40,
            duration_s=8,
            api_key=tenant_key("flood"),
            # Like the OpenAI SDK: back off ~0.5 s after a 429, ignoring Retry-After. A hotter
            # spin measures the gateway CPU of 2 cores, not admission (that is what rpm limits).
            pause_after_refusal_s=0.5,
        )

        async def light_after_warmup():
            await asyncio.sleep(1)  # let the flood fill the slots and queues first
            return await _light(url, 6)

        return await asyncio.gather(flood, light_after_warmup())

    baseline = asyncio.run(solo()).summary()
    flood_run, light_run = asyncio.run(contended())
    flood, light = flood_run.summary(), light_run.summary()

    print("solo", baseline, "\nlight", light, "\nflood", flood)
    assert light["errors"] == 0 and light["ok"] > 10, light
    assert light["total_p50_ms"] <= 1.3 * baseline["total_p50_ms"], (light, baseline)
    shed = sum(1 for s in flood_run.samples if s.status == 429)
    assert shed > 0, "the flooder was shed"
    assert flood["ok"] > 0, "and still got its fair share of slots"
