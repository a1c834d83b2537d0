"""A client that goes away frees its replica slot: the generation is aborted, not finished."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from serve_app.replica import admin as replica_admin
from tests.e2e.conftest import ALPHA_KEY, APP

pytestmark = pytest.mark.e2e


STREAMS = 50
ABORT_WITHIN_S = 4.0


def _running() -> int:
    """Generations on the replicas, batched or waiting for a batch slot."""
    return sum(
        s["num_requests_running"] + s["num_requests_waiting"]
        for s in replica_admin.all_stats(APP, "pool-primary")
    )


def _generated() -> int:
    return sum(s["generation_tokens"] for s in replica_admin.all_stats(APP, "pool-primary"))


async def test_fifty_dropped_streams_free_every_slot_and_stop_generating(forge_url):
    body = {
        "model": "forge-sim",
        "messages": [{"role": "user", "content": "a long story please"}],
        "max_tokens": 2000,  # ~8 s of decoding if nobody stopped it
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    async with httpx.AsyncClient(base_url=forge_url, timeout=30) as client:
        started = asyncio.Event()
        backends: list[str] = []
        ready = 0

        async def reader() -> int:
            nonlocal ready
            seen = 0
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as response:
                assert response.status_code == 200
                backends.append(response.headers["x-forge-backend"])
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen == 3:
                        ready += 1
                        if ready == STREAMS:
                            started.set()
                        await asyncio.sleep(3600)  # hold the stream open until cancelled
            return seen

        tasks = []
        for _ in range(STREAMS):  # a quick ramp, not one burst: this is not a connect test
            tasks.append(asyncio.create_task(reader()))
            await asyncio.sleep(0.01)
        await asyncio.wait_for(started.wait(), 30)
        during = await asyncio.to_thread(_running)
        for task in tasks:
            task.cancel()  # closes each HTTP connection mid-stream
        await asyncio.gather(*tasks, return_exceptions=True)

    dropped_at = time.monotonic()
    assert backends == ["primary"] * STREAMS
    assert during == STREAMS, "every generation was running on the replicas"
    # Unstopped, each generation runs ~8 s more: idle well before that means they were aborted
    # (a tighter bound only measures how busy the machine is).
    after = during
    while time.monotonic() < dropped_at + ABORT_WITHIN_S:
        after = await asyncio.to_thread(_running)
        if after == 0:
            break
        await asyncio.sleep(0.05)
    assert after == 0, (
        f"{after} generations still running {ABORT_WITHIN_S:g} s after their clients left"
    )
    generated = await asyncio.to_thread(_generated)
    await asyncio.sleep(0.5)
    assert await asyncio.to_thread(_generated) == generated, "tokens generated for nobody"
