"""LoRA adapters' names, and how a request's adapter travels from the gateway to a replica.

A pool's adapter ``support`` over model ``qwen`` is called as ``qwen:support`` (or through a
``models:`` entry whose variant names it, or by a tenant bound to it calling ``qwen``); the
gateway's parse stage decides which adapter a request gets (``traffic/policy.py``) and writes
its bare name into the body under ``ADAPTER_KEY``, which the pool's router reads to prefer the
replicas that have it loaded (``routing/adapters.py``) and the replica's engine reads to serve
it (vLLM: a ``LoRARequest``). A client's own ``ADAPTER_KEY`` is always dropped first, so the
key means only what the gateway decided.
"""

from __future__ import annotations

ADAPTER_KEY = "forge_adapter"
SEPARATOR = ":"


def adapter_model(model: str, adapter: str | None) -> str:
    """The served name of ``model`` with ``adapter`` (``model`` itself without one)."""
    return model if adapter is None else f"{model}{SEPARATOR}{adapter}"


def split_adapter_model(name: str) -> tuple[str, str | None]:
    """``"qwen:support"`` → ``("qwen", "support")``; a name without the separator has no
    adapter. The last separator splits, so a base model's own name may hold one."""
    base, sep, adapter = name.rpartition(SEPARATOR)
    return (base, adapter) if sep and base and adapter else (name, None)


def request_adapter(body: dict | None) -> str | None:
    """The adapter the gateway chose for this request body (None: the base model)."""
    adapter = (body or {}).get(ADAPTER_KEY)
    return adapter if isinstance(adapter, str) and adapter else None
