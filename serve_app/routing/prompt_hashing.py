"""A request's prompt as block hashes, the way the pool's engine names its cached blocks.

The routers match a prompt's blocks against what the replicas announce, so they must hash as
the pool's engine does; one implementation per engine kind, chosen per pool (``for_pool``
builds the options in the app builder, ``build_prompt_hasher`` the hasher in each router):

- ``SimulatedPromptHasher``: Forge's word-piece tokenizer and block-hash chain, the simulated
  engine's own (``serve_app/tokenizer.py``, ``serve_app/kvcache/block_hashes.py``).
- ``VllmPromptHasher``: the served model's tokenizer and chat template from its directory
  (``routing/model_tokenizer.py``) and vLLM's block hashing (``kvcache/vllm_block_hashes.py``),
  with the LoRA adapter and cache salt folded in as vLLM folds them: an adapter's blocks are
  named apart from the base model's, so the index can remember them too (``keys_adapters``).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from serve_app import tokenizer
from serve_app.adapters import adapter_model, request_adapter
from serve_app.kvcache.block_hashes import prefix_block_hashes
from serve_app.kvcache.vllm_block_hashes import VllmBlockHasher, lora_extra_key
from serve_app.protocol import prompt_text
from serve_app.routing.base import RouteRequest

logger = logging.getLogger("ray.serve")

# Enough text for the first blocks a policy looks at; tokenizing a 100 kB prompt per request
# to hash 4 blocks of it would cost more than the routing decision.
PREFIX_CHARS = 16_384
# Of a prompt cut at PREFIX_CHARS, the last tokens may differ from the whole prompt's (a word
# cut in two): the blocks holding them are not hashed.
_CUT_MARGIN_TOKENS = 16


class PromptHasher(Protocol):
    # True when an adapter's request is hashed apart from the base model's, as its engine
    # caches it: the router may then remember its blocks where it sent it.
    keys_adapters: bool

    def route(self, body: dict, kind: str) -> RouteRequest: ...

    def follow(self, block_hashing: dict) -> None:
        """Hash as a replica says its engine does (``Engine.block_hashing``)."""


class SimulatedPromptHasher:
    """The simulated engine's tokens and chain (its adapters' salting is its own: not here)."""

    keys_adapters = False

    def __init__(self, block_size: int, route_blocks: int) -> None:
        self.block_size = block_size
        self.route_blocks = route_blocks

    def follow(self, block_hashing: dict) -> None:
        pass  # the simulator's chain and block size are the pool's config

    def route(self, body: dict, kind: str) -> RouteRequest:
        try:
            text = prompt_text(body, kind)[:PREFIX_CHARS]
        except (KeyError, IndexError, TypeError):
            return RouteRequest()
        ids = tokenizer.encode(text)
        hashes = prefix_block_hashes(ids[: self.block_size * self.route_blocks], self.block_size)
        return RouteRequest(
            hashes,
            prompt_tokens=len(ids),
            block_size=self.block_size,
            adapter=request_adapter(body),
        )


class VllmPromptHasher:
    """vLLM's token ids and block hashes for a request (see the module docstring).

    ``adapters``: adapter name → the path its replicas load it from (part of vLLM's key).
    ``chat_template`` and ``chat_template_kwargs``: the engine's ``--chat-template`` and
    ``--default-chat-template-kwargs``, when the pool sets them.
    """

    keys_adapters = True

    def __init__(
        self,
        model_dir: str,
        served_model: str,
        block_size: int,
        route_blocks: int,
        adapters: dict[str, str] | None = None,
        algo: str = "sha256",
        seed: str | None = None,
        segment_cache: int = 1024,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> None:
        from serve_app.routing.model_tokenizer import ModelTokenizer

        self.tokenizer = ModelTokenizer(model_dir, segment_cache, chat_template)
        # The engine's defaults (vLLM's --default-chat-template-kwargs), under the request's.
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.hasher: VllmBlockHasher | None = VllmBlockHasher(algo, seed)
        self._followed: tuple | None = None
        self.served_model = served_model
        self.block_size = block_size
        self.route_blocks = route_blocks
        self.adapters = dict(adapters or {})

    def token_ids(self, body: dict, kind: str) -> tuple[list[int], bool]:
        """The prompt's token ids as vLLM will see them (as far as the router reads), and
        whether the text was cut."""
        if kind == "chat":
            kwargs = {**self.chat_template_kwargs, **(body.get("chat_template_kwargs") or {})}
            for name in ("add_generation_prompt", "continue_final_message"):
                if name in body:
                    kwargs[name] = body[name]
            tools = body.get("tools")
            text = self.tokenizer.render_chat(
                vllm_messages(body["messages"]),
                vllm_tools(tools) if isinstance(tools, list) else None,
                **kwargs,
            )
            add_special = bool(body.get("add_special_tokens", False))
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return list(prompt), False  # token ids: vLLM takes them as they are
            text = prompt if isinstance(prompt, str) else prompt[0]
            add_special = bool(body.get("add_special_tokens", True))
        cut = len(text) > PREFIX_CHARS
        ids = self.tokenizer.encode(text[:PREFIX_CHARS], add_special)
        return (ids[:-_CUT_MARGIN_TOKENS] if cut else ids), cut

    def follow(self, block_hashing: dict) -> None:
        """Hash as the replicas' vLLM does, as they report it: the pool's config may not know
        its seed (``PYTHONHASHSEED`` set for the whole Ray cluster or the application) nor the
        block size vLLM settled on. An algorithm the router cannot follow (xxhash) leaves
        requests unhashed: routed by load, as their names would never meet."""
        settings = tuple(block_hashing.get(k) for k in ("algo", "seed", "block_size"))
        if settings == self._followed:
            return
        self._followed = settings
        algo, seed, block_size = settings
        try:
            self.hasher = VllmBlockHasher(algo or "sha256", seed)
        except ValueError as exc:
            self.hasher = None
            logger.warning("pool model %s: %s; routing by load only", self.served_model, exc)
        if isinstance(block_size, int) and block_size > 0:
            self.block_size = block_size

    def route(self, body: dict, kind: str) -> RouteRequest:
        adapter = request_adapter(body)
        if self.hasher is None:
            return RouteRequest(block_size=self.block_size, adapter=adapter)
        lora = None
        if adapter is not None:
            path = self.adapters.get(adapter)
            if path is None:  # the replica answers 404; nothing to find
                return RouteRequest(adapter=adapter)
            lora = lora_extra_key(adapter_model(self.served_model, adapter), path)
        try:
            ids, _ = self.token_ids(body, kind)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            logger.debug("not hashed for routing: %s", exc)
            return RouteRequest(adapter=adapter)
        salt = body.get("cache_salt")
        hashes = self.hasher.block_hashes(
            ids[: self.block_size * self.route_blocks],
            self.block_size,
            lora,
            salt if isinstance(salt, str) else None,
        )
        return RouteRequest(
            hashes, prompt_tokens=len(ids), block_size=self.block_size, adapter=adapter
        )


_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM strips it from system text


def vllm_messages(messages: list) -> list[dict]:
    """The messages as vLLM hands them to the chat template (its "string" content format):
    content as one string (text parts joined by newlines, none as ""; a system part's Claude
    Code billing header line dropped, as vLLM drops it), only the keys vLLM keeps, and an
    assistant's tool-call arguments parsed into objects (``{}`` when empty or not an object).
    Copies: the body itself goes on to the replica unchanged."""
    out = []
    for message in messages:
        role, content = message["role"], message.get("content")
        parts = [content] if isinstance(content, str) else content or []
        texts = []
        for part in parts:
            text = part if isinstance(part, str) else part.get("text")
            if not isinstance(part, str) and part.get("type") != "text":
                continue
            if role == "system" and isinstance(text, str) and text.startswith(_BILLING_HEADER):
                text = text.partition("\n")[2]
                if not text:
                    continue
            texts.append(text or "")
        rendered: dict = {"role": role, "content": "\n".join(texts)}
        if role == "assistant":
            calls = message.get("tool_calls")
            if calls:
                rendered["tool_calls"] = [_vllm_tool_call(c) for c in calls]
            if message.get("reasoning") is not None:
                rendered["reasoning"] = rendered["reasoning_content"] = message["reasoning"]
        elif role == "tool" and "tool_call_id" in message:
            rendered["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            rendered["name"] = message["name"]
        out.append(rendered)
    return out


def _vllm_tool_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": function}


def vllm_tools(tools: list) -> list:
    """Tool definitions as vLLM hands them to the chat template: its parsed model of each,
    dumped (``tool.model_dump()``), so in its field order, an absent description or parameters
    as None, and strict or defer_loading only when set. Templates print them (``tojson``), so
    the same tools in another key order are other tokens."""
    dumped = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            return tools  # vLLM refuses it: nothing to match
        out = {k: function.get(k) for k in ("name", "description", "parameters")}
        out.update(
            {k: function[k] for k in ("strict", "defer_loading") if function.get(k) is not None}
        )
        entry = {"type": tool.get("type", "function"), "function": out}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        dumped.append(entry)
    return dumped


def for_pool(pool: Any) -> dict[str, Any]:
    """The options ``build_prompt_hasher`` takes, from a ``PoolConfig``.

    A vLLM engine's hash seed is ``PYTHONHASHSEED`` where the replica runs: the pool's
    ``deployment.ray_actor_options.runtime_env.env_vars`` when it pins it there, else unset.
    """
    engine = pool.engine
    if engine.kind != "vllm":
        return {"kind": engine.kind}
    env = ((pool.deployment.get("ray_actor_options") or {}).get("runtime_env") or {}).get(
        "env_vars"
    ) or {}
    return {
        "kind": "vllm",
        "model_dir": engine.model,
        "served_model": pool.model,
        "adapters": {a.name: a.path for a in pool.adapters},
        "algo": engine.engine_args.get("prefix_caching_hash_algo", "sha256"),
        "seed": env.get("PYTHONHASHSEED"),
        "chat_template": engine.engine_args.get("chat_template"),
        "chat_template_kwargs": engine.engine_args.get("default_chat_template_kwargs"),
    }


def build_prompt_hasher(
    options: dict[str, Any] | None, block_size: int, route_blocks: int
) -> PromptHasher:
    """The pool's hasher. A vLLM pool whose model directory the gateway cannot read is routed
    by its replicas' load alone (said once in the log): the simulator's hashes would never
    meet its replicas' blocks, and a wrong match is worse than none."""
    options = dict(options or {})
    if options.pop("kind", "simulated") != "vllm":
        return SimulatedPromptHasher(block_size, route_blocks)
    try:
        return VllmPromptHasher(block_size=block_size, route_blocks=route_blocks, **options)
    except (OSError, ImportError, ValueError) as exc:
        logger.warning(
            "pool model %s: no prompt hashing for routing (%s); routing by load only",
            options.get("model_dir"),
            exc,
        )
        return _NoPromptHasher(block_size)


class _NoPromptHasher:
    keys_adapters = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def follow(self, block_hashing: dict) -> None:
        pass

    def route(self, body: dict, kind: str) -> RouteRequest:
        return RouteRequest(block_size=self.block_size, adapter=request_adapter(body))
