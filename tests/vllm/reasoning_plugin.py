"""A reasoning parser for the tiny model, loaded as an operator loads their own
(``engine_args``' ``reasoning_parser_plugin``; ``serve_app/engines/vllm_engine.py``).

It is vLLM's ``deepseek_v3`` parser with other markers: a request that turns thinking on
(``chat_template_kwargs``' ``enable_thinking`` or ``thinking``) is read by DeepSeek R1's parser,
any other by the identity parser, so every other test's answers are what they are without it.
The tiny model has no ``<think>`` tokens; its tool-call markers stand in (one added token each, as
Qwen3's ``<think>`` is). It does not close its thought unprompted, so a thinking answer is
reasoning from its first token to its last, as an R1 model's is until it writes ``</think>``.
"""

from __future__ import annotations

from vllm.reasoning import ReasoningParser, ReasoningParserManager
from vllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from vllm.reasoning.deepseek_v3_reasoning_parser import DeepSeekV3ReasoningParser
from vllm.reasoning.identity_reasoning_parser import IdentityReasoningParser

NAME = "forge-tiny"  # conftest.py's REASONING_PARSER


class _TinyThoughts(DeepSeekR1ReasoningParser):
    @property
    def start_token(self) -> str:
        return "<tool_call>"

    @property
    def end_token(self) -> str:
        return "</tool_call>"


@ReasoningParserManager.register_module(NAME)
class TinyReasoningParser(DeepSeekV3ReasoningParser):
    def __init__(self, tokenizer, *args, **kwargs):
        ReasoningParser.__init__(self, tokenizer, *args, **kwargs)
        switch = kwargs.get("chat_template_kwargs") or {}
        thinking = bool(switch.get("thinking")) or bool(switch.get("enable_thinking"))
        parser = _TinyThoughts if thinking else IdentityReasoningParser
        self._parser = parser(tokenizer, *args, **kwargs)
