"""The Engine contract (``tests/engines/contract.py``) on the simulated engine, with no delays."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from serve_app import tokenizer
from serve_app.config.models import SimulatedEngineConfig
from serve_app.engines.base import Kind
from serve_app.engines.simulated import SimulatedEngine
from serve_app.protocol import prompt_text
from tests.engines.contract import EngineContract, EngineSpec

# Zero-cost steps: a step per event-loop turn, so nothing here waits on a clock.
CONFIG = SimulatedEngineConfig(max_num_seqs=3, output_tokens_min=4, output_tokens_max=12)


def count_prompt_tokens(body: dict, kind: Kind) -> int:
    """The gateway's tokenizer over the rendered prompt: what the simulator counts with."""
    return tokenizer.count_tokens(prompt_text(body, kind))


SPEC = EngineSpec(
    model="sim-model",
    default_max_tokens=16,
    max_num_seqs=CONFIG.max_num_seqs,
    max_model_len=CONFIG.max_model_len,
    block_size=CONFIG.block_size,
    count_prompt_tokens=count_prompt_tokens,
    settle_s=0.0,  # its stats are exact at every moment: checked at once, never waited for
    poll_interval_s=0.0,
)


class TestSimulatedEngineContract(EngineContract):
    @pytest.fixture
    async def engine(self) -> AsyncIterator[SimulatedEngine]:
        engine = SimulatedEngine(SPEC.model, CONFIG, SPEC.default_max_tokens)
        await engine.start()
        yield engine
        await engine.shutdown()

    @pytest.fixture
    def spec(self) -> EngineSpec:
        return SPEC
