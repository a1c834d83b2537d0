"""A deterministic word-piece tokenizer for the simulated engine and for prompt accounting.

Real tokenizers need model files; the simulated replica and the gateway's token estimates only
need a rule that is cheap, stable across processes and exact enough that the prompt tokens the
gateway reserves equal the ``usage.prompt_tokens`` the replica reports. The rule: a token is a
run of word characters or a single other non-space character, together with the white space
before it. ``"".join(tokenize(s)) == s.rstrip()`` for any text without trailing white space.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable, Sequence

_PIECE = re.compile(r"\s*(?:<\|im_(?:start|end)\|>|\w+|[^\w\s])")

# Chat template in the ChatML shape many open models use; the markers are single tokens.
_SPECIAL = ("<|im_start|>", "<|im_end|>")


def tokenize(text: str) -> list[str]:
    """Split text into token pieces (see module docstring)."""
    return _PIECE.findall(text)


def token_id(piece: str) -> int:
    """Stable id of a piece, the same in every process (unlike ``hash``)."""
    return zlib.crc32(piece.encode()) & 0x7FFFFFFF


def encode(text: str) -> list[int]:
    return [token_id(p) for p in tokenize(text)]


def count_tokens(text: str) -> int:
    return len(_PIECE.findall(text))


def render_chat(
    messages: Iterable[dict], tools: list | None = None, *, continue_final: bool = False
) -> str:
    """Render chat messages with a ChatML template, ending with the assistant's turn. Tool
    definitions, an assistant's tool calls and (as Qwen3's template has it) the current turn's
    reasoning are part of the prompt, as in real templates.
    ``continue_final`` (vLLM's ``continue_final_message``): the last message is left open, to
    be continued, and no new turn is opened after it."""
    parts = []
    if tools:
        parts.append(f"{_SPECIAL[0]} tools\n{json.dumps(tools, sort_keys=True)} {_SPECIAL[1]}\n")
    messages = list(messages)
    # Qwen3's template keeps an assistant's reasoning only after the last user message (the
    # current turn's tool loop); earlier turns' reasoning is left out of the prompt.
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, as vLLM joins them
            content = "\n".join(
                p.get("text") or ""
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        reasoning = m.get("reasoning") or m.get("reasoning_content")
        if i > last_user and m.get("role") == "assistant" and isinstance(reasoning, str):
            content = f"<think>\n{reasoning}\n</think>\n\n{content or ''}"
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            content = (content or "") + json.dumps(calls, sort_keys=True)
        parts.append(f"{_SPECIAL[0]} {m.get('role', 'user')}\n{content or ''} {_SPECIAL[1]}\n")
    if continue_final and parts:
        parts[-1] = parts[-1][: -len(f" {_SPECIAL[1]}\n")]
        return "".join(parts)
    parts.append(f"{_SPECIAL[0]} assistant\n")
    return "".join(parts)


# Output vocabulary of the simulated model: enough variety that texts differ visibly.
OUTPUT_WORDS: Sequence[str] = tuple(
    " " + w
    for w in (
        "the of and to in is that for it as with was on be by at this from or an are not have "
        "which one you had but were all their there been has when who will more no if out so "
        "said what up its about into than them can only other new some could time these two "
        "may then do first any my now such like our over man me even most made after also did "
        "many before must through back years where much your way well down should because each "
        "just those people how too little state good very make world still own see men work "
        "long get here between both life being under never day same another know while last "
        "might us great old year off come since against go came right used take three"
    ).split()
)
