"""The ingress paths: Serve's proxy and (in throughput-optimized mode) direct ingress."""

from __future__ import annotations

import asyncio
import os

import pytest

from loadtest.http_load import closed_loop
from serve_app.replica import admin as replica_admin
from tests.e2e.conftest import ALPHA_KEY, APP

pytestmark = pytest.mark.e2e

BODY = {
    "model": "forge-sim",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 8,
    "stream": True,
}


@pytest.mark.skipif(
    os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") != "1", reason="direct ingress is off"
)
def test_direct_ingress_port_serves_the_same_api(forge_url):
    import openai

    url = replica_admin.direct_ingress_url(APP)
    assert url, "the gateway replica listens on its own port"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=ALPHA_KEY, max_retries=0)
    result = client.chat.completions.create(model="forge-sim", messages=BODY["messages"])
    assert result.usage.completion_tokens > 0


@pytest.mark.parametrize("path", ["proxy", "direct"])
def test_64_clients_closing_right_after_done_never_stall(forge_url, path):
    """A trap seen in throughput-optimized mode: streams stalled when clients hung up at once."""
    url = forge_url if path == "proxy" else replica_admin.direct_ingress_url(APP)
    if url is None:
        pytest.skip("direct ingress is off")

    async def run():
        return await asyncio.wait_for(
            closed_loop(
                f"{url}/v1/chat/completions",
                BODY,
                concurrency=64,
                requests=256,
                api_key=ALPHA_KEY,
                keep_alive=False,
            ),
            timeout=60,
        )

    result = asyncio.run(run())
    assert result.errors == 0
    assert len(result.ok()) == 256
    assert all(s.chunks == 11 for s in result.ok()), "role + 8 tokens + finish + [DONE]"
