"""A client that goes away frees its replica slot: the generation is aborted, not finished."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from serve_app import replica_admin
from tests.e2e.conftest import ALPHA_KEY, APP

pytestmark = pytest.mark.e2e


def _running() -> int:
    return sum(s["num_requests_running"] for s in replica_admin.all_stats(APP, "pool-primary"))


async def test_twenty_dropped_streams_free_every_slot(forge_url):
    body = {
        "model": "forge-sim",
        "messages": [{"role": "user", "content": "a long story please"}],
        "max_tokens": 4000,  # ~16 s of decoding if nobody stopped it
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    async with httpx.AsyncClient(base_url=forge_url, timeout=30) as client:
        started = asyncio.Event()
        ready = 0

        async def reader() -> int:
            nonlocal ready
            seen = 0
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen == 3:
                        ready += 1
                        if ready == 20:
                            started.set()
                        await asyncio.sleep(3600)  # hold the stream open until cancelled
            return seen

        tasks = [asyncio.create_task(reader()) for _ in range(20)]
        await asyncio.wait_for(started.wait(), 30)
        during = await asyncio.to_thread(_running)
        for task in tasks:
            task.cancel()  # closes each HTTP connection mid-stream
        await asyncio.gather(*tasks, return_exceptions=True)

    assert during == 20, "all twenty generations were running on the replicas"
    deadline = time.monotonic() + 5
    after = during
    while time.monotonic() < deadline:
        after = await asyncio.to_thread(_running)
        if after == 0:
            break
        await asyncio.sleep(0.1)
    assert after == 0, f"{after} generations kept running after their clients left"
