"""Build a tiny random Llama checkpoint that vLLM can serve, offline, in seconds.

The real-vLLM tests and ``configs/local-vllm.yaml`` need a model directory, and nothing here may
download weights. The output is nonsense text, but everything the gateway relies on is real:
vLLM's tokenizer, chat template (Qwen2.5's, tools included), tool-call parsing and grammar,
scheduler, KV cache, prefix cache, streaming and metrics.

    python -m serve_app.tools.tiny_model PATH

Same seed, same files: the tokenizer is trained on fixed sentences and the weights are drawn
from a seeded generator, so test expectations (token counts) hold from build to build.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# Qwen2.5's ChatML template, tools section included, so prompts render like a production model's
# and tool calls take Qwen2.5's (Hermes-style) shape, which vLLM's ``hermes`` parser reads back.
# Without tools a conversation renders as plain ChatML (no default system prompt); with tools a
# system turn lists them in ``<tools>``, an assistant's calls become ``<tool_call>`` blocks and
# tool results ``<tool_response>`` blocks in a user turn.
CHATML_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and ' }}
    {{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' and tools and loop.first %}
        {#- already in the tools turn #}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] %}
        {{- '<|im_start|>assistant' }}
        {%- if message['content'] %}
            {{- '\n' + message['content'] }}
        {%- endif %}
        {%- for call in message['tool_calls'] %}
            {%- set call = call['function'] if call['function'] is defined else call %}
            {%- set arguments = call['arguments'] %}
            {{- '\n<tool_call>\n{"name": "' + call['name'] + '", "arguments": ' }}
            {{- (arguments if arguments is string else arguments | tojson) + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message['role'] == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's tool-call markers: added tokens, but not special ones, so they decode into the text
# (vLLM's Hermes parser and its tool-call grammar work on the text), one token each as in Qwen2.5.
TOOL_CALL_TOKENS = ["<tool_call>", "</tool_call>"]
VOCAB_SIZE = 512
SEED = 0

_CORPUS = [
    "Forge is an OpenAI-compatible gateway in front of vLLM replicas.",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you.",
    "Tenants have budgets: requests per minute and tokens per minute.",
    "A prefix cache keeps the key and value blocks of prompts it has seen.",
    "Streaming answers arrive as server-sent events, one token at a time.",
    "user assistant system: write a short poem about the sea and the sky.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def vllm_engine_config(path: str | Path, **overrides) -> dict:
    """The ``engine`` block that serves this model on vLLM's CPU build (as the vLLM tests, the
    overhead benchmark and configs/local-vllm.yaml do)."""
    return {
        "kind": "vllm",
        "model": str(path),
        # Long enough for a generation that is still running when a test walks away from it.
        "max_model_len": 2048,
        "max_num_seqs": 4,
        "block_size": 32,  # vLLM's CPU attention needs a multiple of 32
        "dtype": "float32",
        "enforce_eager": True,
        "engine_args": {
            # 64 MiB of KV cache is ~65k tokens of this model; vLLM's CPU default is far larger.
            "kv_cache_memory_bytes": 64 << 20,
            # The chat template writes tool calls as Qwen2.5 does: vLLM's Hermes parser reads them.
            "enable_auto_tool_choice": True,
            "tool_call_parser": "hermes",
        },
        **overrides,
    }


def build_tokenizer():
    """A byte-level BPE (any text encodes) with ChatML's special tokens and Qwen2.5's tool-call
    tokens (ids ``VOCAB_SIZE`` and up, after the trained vocabulary, which they leave as it was)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_CALL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_model(tokenizer):
    """A 2-layer Llama with grouped-query attention (2 heads, 1 KV head), random weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    return LlamaForCausalLM(config).to(torch.float32)


def build(path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="directory to write the model into (created if missing)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch a hub
    print(build(args.path))


if __name__ == "__main__":
    main()
