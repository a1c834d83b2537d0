"""A flooding tenant sheds itself while a light tenant is served without a refusal (fair
admission). How much latency the light tenant keeps is a benchmark: ``loadtest/fairness.py``."""

from __future__ import annotations

import asyncio

import pytest

from loadtest import fairness
from loadtest.http_load import closed_loop
from serve_app.replica import admin as replica_admin
from tests.e2e.conftest import APP, tenant_key

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The drill's request (loadtest/fairness.py), sent to the test graph's fair-admission pool.
BODY = {**fairness.BODY, "model": "forge-fair"}
# The flooding tenant's share of the pool's 8 slots (max_tenant_share 0.75 in the conftest).
SHARE = 6


def _light(url: str, duration_s: float):
    return closed_loop(url, BODY, concurrency=2, duration_s=duration_s, api_key=tenant_key("light"))


def test_flooder_sheds_alone_while_light_tenant_keeps_its_latency(forge_url):
    # Direct ingress where it is on: on 2 cores the proxy hop's CPU would be what we measure.
    base = replica_admin.direct_ingress_url(APP) or forge_url
    url = f"{base}/v1/chat/completions"

    async def fair_load():
        # The baseline: the other tenant sends no more than its share of slots (6 of 8), so the
        # batch the light tenant joins, and the CPU the served requests cost, are what they will
        # be under the flood; only the flood's excess (queued, then shed) differs. Against a
        # light tenant alone, the ratio would measure this host's CPU per batched token instead
        # of admission (on a slow host, 1.6x for the same code that gave 1.2x on a fast one).
        polite = closed_loop(
            url, BODY, concurrency=SHARE, duration_s=7, api_key=tenant_key("flood")
        )

        async def light_after_warmup():
            await asyncio.sleep(1)
            return await _light(url, 6)

        return await asyncio.gather(polite, light_after_warmup())

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

    _, baseline_run = asyncio.run(fair_load())
    baseline = baseline_run.summary()
    flood_run, light_run = asyncio.run(contended())
    flood, light = flood_run.summary(), light_run.summary()

    print("light beside a fair share", baseline, "\nlight", light, "\nflood", flood)
    assert light["errors"] == 0 and light["ok"] > 10, light
    assert not [s for s in light_run.samples if s.status == 429], "the light tenant never shed"
    # The light tenant's latency under the flood against its baseline is a measurement, not a
    # verdict here: on 2 shared cores the same code measured 1.2x to 1.9x its baseline from one
    # run to the next (unfair admission would be several times). `python -m loadtest.fairness`
    # measures it with its spread (docs/benchmarks.md, "Fair admission under a flood").
    print(f"light p50 under the flood: {light['total_p50_ms'] / baseline['total_p50_ms']:.2f}x")
    shed = sum(1 for s in flood_run.samples if s.status == 429)
    assert shed > 0, "the flooder was shed"
    assert flood["ok"] > 0, "and still got its fair share of slots"
