"""A served model's tokenization in the router, on a small tokenizer made here (no model files,
no vLLM): the segment cache changes nothing but the cost, and ``VllmPromptHasher`` keys what
vLLM keys. Against vLLM itself: ``tests/vllm/test_prompt_hashes_vllm.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from serve_app.adapters import ADAPTER_KEY
from serve_app.app import _replica_options
from serve_app.bridge import reset_bridges
from serve_app.config.models import PoolConfig
from serve_app.kvcache.vllm_block_hashes import VllmBlockHasher, lora_extra_key
from serve_app.routing.model_tokenizer import ModelTokenizer
from serve_app.routing.prompt_hashing import (
    PREFIX_CHARS,
    VllmPromptHasher,
    build_prompt_hasher,
    for_pool,
)
from serve_app.routing.serve_router import ForgeRequestRouter

TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYSTEM = "You answer questions about harbours, tides and the ships that use them. " * 6
WORDS = "the sea tide ship harbour quay light house answer question about tell me and of"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A byte-level BPE with ChatML's added tokens, a chat template and a tokenizer config."""
    root = tmp_path_factory.mktemp("model")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([SYSTEM, WORDS] * 20, trainer)
    tok.add_special_tokens(
        [AddedToken(t, normalized=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    )
    tok.save(str(root / "tokenizer.json"))
    (root / "chat_template.jinja").write_text(TEMPLATE)
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def chat(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_the_segment_cache_gives_the_tokenizers_own_ids(model_dir):
    cached = ModelTokenizer(model_dir)
    text = cached.render_chat(chat("tell me about the tide"))
    whole = cached.tokenizer.encode(text, add_special_tokens=False).ids

    assert cached.encode(text) == whole
    assert len(cached._segments) == 1, "the system turn, the one long segment"
    again = cached.render_chat(chat("and the quay?"))
    assert cached.encode(again) == cached.tokenizer.encode(again, add_special_tokens=False).ids
    assert len(cached._segments) == 1, "its system turn came from the cache"


def test_the_template_gets_vllms_chat_defaults(model_dir):
    tokenizer = ModelTokenizer(model_dir)
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]

    assert (
        tokenizer.render_chat(parts) == "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.render_chat(parts, add_generation_prompt=False).endswith("<|im_end|>\n")


def hasher(model_dir: Path) -> VllmPromptHasher:
    return VllmPromptHasher(
        str(model_dir), "tiny", block_size=4, route_blocks=128, adapters={"support": "/a/support"}
    )


def test_an_adapters_request_is_keyed_by_the_lora_vllm_serves_it_as(model_dir):
    prompts = hasher(model_dir)
    body = {"messages": chat("tell me about the tide")}

    base = prompts.route(body, "chat")
    support = prompts.route({**body, ADAPTER_KEY: "support"}, "chat")
    unknown = prompts.route({**body, ADAPTER_KEY: "nobody"}, "chat")

    ids, _ = prompts.token_ids(body, "chat")
    assert base.block_hashes == VllmBlockHasher().block_hashes(ids, 4)
    lora = lora_extra_key("tiny:support", "/a/support")
    assert support.block_hashes == VllmBlockHasher().block_hashes(ids, 4, lora)
    assert not set(support.block_hashes) & set(base.block_hashes)
    assert (unknown.block_hashes, unknown.adapter) == ((), "nobody")  # its replica answers 404


def test_a_prompt_cut_for_routing_hashes_only_blocks_the_whole_prompt_has(model_dir):
    prompts = hasher(model_dir)
    long_prompt = (WORDS + " ") * (PREFIX_CHARS // len(WORDS) + 10)
    whole = prompts.tokenizer.encode(long_prompt, add_special_tokens=True)

    cut = prompts.route({"prompt": long_prompt}, "completion")

    full = VllmBlockHasher().block_hashes(whole, 4)
    assert cut.block_hashes and len(cut.block_hashes) < len(full)
    assert cut.block_hashes == full[: len(cut.block_hashes)]


def test_the_hasher_follows_the_seed_and_block_size_its_replicas_report(model_dir):
    prompts = hasher(model_dir)
    body = {"prompt": list(range(40))}

    prompts.follow({"algo": "sha256", "seed": "0", "block_size": 8})

    assert prompts.route(body, "completion").block_hashes == VllmBlockHasher(
        "sha256", "0"
    ).block_hashes(list(range(40)), 8)
    prompts.follow({"algo": "xxhash", "block_size": 8})  # seeded per process: cannot follow
    assert prompts.route(body, "completion").block_hashes == ()


def test_token_id_prompts_are_hashed_as_given(model_dir):
    route = hasher(model_dir).route({"prompt": list(range(10))}, "completion")

    assert route.block_hashes == VllmBlockHasher().block_hashes(list(range(10)), 4)
    assert route.prompt_tokens == 10


def test_a_vllm_pools_routers_are_built_with_its_models_hasher(model_dir):
    """The app builder's router options for a vLLM pool give its routers vLLM's hashing."""
    pool = PoolConfig.model_validate(
        {
            "model": "tiny",
            "engine": {"kind": "vllm", "model": str(model_dir), "block_size": 4},
            "routing": {"policy": "prefix_affinity"},
        }
    )
    kwargs = _replica_options(pool)["request_router_config"].request_router_kwargs
    router = ForgeRequestRouter(
        deployment_id=DeploymentID(name="pool-primary", app_name="forge-test"),
        handle_source=DeploymentHandleSource.REPLICA,
    )
    router.initialize_state(**kwargs)
    reset_bridges()  # the router registered its pool's bridge: leave none behind
    body = {"messages": chat("tell me about the tide")}

    assert isinstance(router.hasher, VllmPromptHasher)
    ids, _ = router.hasher.token_ids(body, "chat")
    assert router.hasher.route(body, "chat").block_hashes == VllmBlockHasher().block_hashes(ids, 4)


def test_the_engines_own_chat_template_and_its_default_kwargs_are_the_routers(model_dir):
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    pool = PoolConfig.model_validate(
        {
            "model": "tiny",
            "engine": {
                "kind": "vllm",
                "model": str(model_dir),
                "engine_args": {
                    "chat_template": template,
                    "default_chat_template_kwargs": {"greeting": "ahoy "},
                },
            },
        }
    )
    prompts = build_prompt_hasher(for_pool(pool), block_size=4, route_blocks=128)
    body = {"messages": [{"role": "user", "content": "tide"}]}

    def rendered(body: dict) -> str:
        return prompts.tokenizer.tokenizer.decode(prompts.token_ids(body, "chat")[0])

    assert rendered(body) == "ahoy tide"
    assert rendered({**body, "chat_template_kwargs": {"greeting": "hi "}}) == "hi tide"
