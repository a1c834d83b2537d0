"""A redeploy under streaming load truncates nothing: replaced replicas drain their streams.

Its own small app (``/drain``), so replacing its replicas leaves the session's graph alone. The
change is a replica option (the engine's decode time), which makes Serve replace every pool
replica, and the gateway's too (its config argument changed with it).
"""

from __future__ import annotations

import asyncio
import hashlib

import httpx
import orjson
import pytest

from tests.e2e.conftest import ALPHA_KEY, LEDGER_PATH

# In the default run, not the slow one: in the slow run's session it ran just before the
# fair-admission drill, whose light tenant then measured 1.9x its baseline (1.4x without it).
# A rollout drill (~40 s of the graph's CPU): in the slow run, beside what it would slow.
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

APP = "forge-drain"
STREAMS = 12
TOKENS = 150  # ~2 s per stream: every one of them is mid-way when the rollout starts


def drain_args(decode_s: float) -> dict:
    return {
        "metering": {"sqlite_path": LEDGER_PATH},
        "tenants": [
            {"name": "alpha", "key_hashes": [hashlib.sha256(ALPHA_KEY.encode()).hexdigest()]}
        ],
        "pools": [
            {
                "name": "drain",
                "model": "forge-drain",
                "engine": {"decode_base_s": decode_s, "max_num_seqs": 32},
                "fallback": False,
                "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
            }
        ],
        "gateway": {"deployment": {"ray_actor_options": {"num_cpus": 0}}},
    }


async def test_a_redeploy_under_streaming_load_truncates_no_stream(forge_url):
    from ray import serve

    from serve_app.app import build_app

    await asyncio.to_thread(
        serve.run, build_app(drain_args(0.012)), name=APP, route_prefix="/drain"
    )
    body = {
        "model": "forge-drain",
        "messages": [{"role": "user", "content": "a long answer"}],
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    started = asyncio.Event()
    running = 0

    async def stream(client: httpx.AsyncClient) -> tuple[int, bool]:
        nonlocal running
        tokens, done = 0, False
        async with client.stream(
            "POST", "/drain/v1/chat/completions", json=body, headers=headers
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = orjson.loads(line[6:])
                    assert "error" not in chunk, chunk
                    tokens += sum(bool(c["delta"].get("content")) for c in chunk["choices"])
                    if tokens == 5:
                        running += 1
                        if running == STREAMS:
                            started.set()
        return tokens, done

    async with httpx.AsyncClient(base_url=forge_url, timeout=60) as client:
        tasks = [asyncio.create_task(stream(client)) for _ in range(STREAMS)]
        await asyncio.wait_for(started.wait(), 30)
        # The rollout: Serve starts new replicas, then stops the old ones once they drained.
        await asyncio.to_thread(
            serve.run, build_app(drain_args(0.013)), name=APP, route_prefix="/drain"
        )
        results = await asyncio.gather(*tasks)
        after = await client.post(
            "/drain/v1/chat/completions", json={**body, "stream": False}, headers=headers
        )
    serve.delete(APP, _blocking=False)  # its replicas drain on their own time
    assert results == [(TOKENS, True)] * STREAMS, "every stream whole, each ending with [DONE]"
    assert after.status_code == 200  # and the new version serves
