"""A served model's own prompt tokenization, as vLLM's serving layer does it, without vLLM.

For a vLLM pool the router must hash the token ids vLLM will hash: the model's chat template
rendered over the request's messages (Hugging Face's Jinja environment and variables), then the
model's tokenizer (``tokenizer.json``, through the ``tokenizers`` package: no transformers, no
torch in the gateway). Chat prompts are tokenized without the tokenizer's post-processor
(vLLM's chat default, ``add_special_tokens=False``), completion prompts with it.

Tokenizing is the router's main cost per request, and most of it is the long system prompts
that requests share. The tokenizer splits text at its added tokens (``<|im_start|>`` and such)
before anything else, so the text between two of them is tokenized on its own whatever
surrounds it: such a segment, when long, is tokenized once and kept (``segment_cache``
entries, LRU). The result is the same token ids, which a test checks against the uncached path.

Limits, which only make a request miss the index (it is then routed by load), never misroute
another: content parts are joined with newlines (vLLM's "string" content format; a template
that iterates over parts is rendered differently by vLLM). Messages and tool definitions are
the caller's to shape as vLLM does (``prompt_hashing.vllm_messages`` and ``vllm_tools``).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

# A segment between added tokens at least this long is tokenized once and remembered.
_CACHED_SEGMENT_CHARS = 256


class ModelTokenizer:
    """The model directory's tokenizer and chat template (see the module docstring).

    ``chat_template``: the template the engine was told to use instead of the model's (vLLM's
    ``--chat-template``: a file's path, or the template itself).
    """

    def __init__(
        self, model_dir: str | Path, segment_cache: int = 1024, chat_template: str | None = None
    ) -> None:
        from tokenizers import Tokenizer  # a vLLM pool's router only

        root = Path(model_dir)
        try:
            self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception, a missing file included
            raise ValueError(f"no tokenizer in {root}: {exc}") from None
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        template_path = root / "chat_template.jinja"
        source = (
            template_path.read_text() if template_path.exists() else config.get("chat_template")
        )
        if chat_template is not None:
            source = _template_source(chat_template)
        if isinstance(source, list):  # named templates: the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        self.template = _compile(source) if isinstance(source, str) else None
        self.special_tokens = {
            name: value.get("content") if isinstance(value, dict) else value
            for name, value in config.items()
            if name.endswith("_token") and isinstance(value, str | dict | None)
        }
        plain = self.tokenizer.encode("a b", add_special_tokens=False).ids
        self.post_processes = self.tokenizer.encode("a b", add_special_tokens=True).ids != plain
        added = self.tokenizer.get_added_tokens_decoder().values()
        # Splitting at added tokens is exact only where the tokenizer itself splits there.
        splittable = all(not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added)
        contents = sorted((t.content for t in added), key=len, reverse=True)
        self._splitter = (
            re.compile("(" + "|".join(map(re.escape, contents)) + ")")
            if contents and splittable
            else None
        )
        self._segments: OrderedDict[str, list[int]] = OrderedDict()
        self.segment_cache = segment_cache

    def render_chat(self, messages: Sequence[dict], tools: list | None = None, **kwargs) -> str:
        """The chat prompt's text, as vLLM renders it (a generation prompt unless asked not)."""
        if self.template is None:
            raise ValueError("the model has no chat template")
        variables = {
            **self.special_tokens,
            "messages": [_string_content(m) for m in messages],
            "tools": tools,
            "add_generation_prompt": kwargs.pop("add_generation_prompt", True),
            **kwargs,
        }
        return self.template.render(**variables)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if add_special_tokens and self.post_processes:
            return self.tokenizer.encode(text, add_special_tokens=True).ids
        if self._splitter is None or self.segment_cache <= 0:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        ids: list[int] = []
        pending: list[str] = []
        for piece in self._splitter.split(text):
            if len(piece) < _CACHED_SEGMENT_CHARS:
                pending.append(piece)
                continue
            if pending:
                ids += self.tokenizer.encode("".join(pending), add_special_tokens=False).ids
                pending = []
            ids += self._segment(piece)
        if pending:
            ids += self.tokenizer.encode("".join(pending), add_special_tokens=False).ids
        return ids

    def _segment(self, text: str) -> list[int]:
        ids = self._segments.get(text)
        if ids is not None:
            self._segments.move_to_end(text)
            return ids
        ids = self._segments[text] = self.tokenizer.encode(text, add_special_tokens=False).ids
        if len(self._segments) > self.segment_cache:
            self._segments.popitem(last=False)
        return ids


def _template_source(chat_template: str) -> str:
    """vLLM's reading of ``--chat-template``: a file, else the template itself if it looks like
    one (a bare name is one of vLLM's built-in templates, which the router does not have)."""
    try:
        return Path(chat_template).read_text()
    except OSError:
        if any(c in chat_template for c in "{}\n"):
            return chat_template
        raise ValueError(f"chat_template {chat_template!r}: no such file") from None


def _string_content(message: dict) -> dict:
    """vLLM's "string" content format: text parts joined by newlines, others dropped."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    text = "\n".join(
        p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text"
    )
    return {**message, "content": text}


def _compile(source: str) -> Any:
    """The template in Hugging Face's Jinja environment (``apply_chat_template``'s)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
