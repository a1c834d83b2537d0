"""What ``/v1/models`` tells a tenant: the names it may call, each with the context window its
pools take where their configs say it, so a client can size its prompts and ``max_tokens``
without a 400 to learn it.

In OpenAI's shape, with vLLM's own fields (``max_model_len``; ``parent``, an adapter's base
model); or, to Anthropic's SDK (it sends ``anthropic-version`` on every call), in the Messages
API's shape (``max_input_tokens``, ``max_tokens``), paged as that API pages it.
"""

from __future__ import annotations

from collections.abc import Mapping

from serve_app import errors
from serve_app.traffic.policy import TrafficPolicy

_EPOCH = "1970-01-01T00:00:00Z"  # Anthropic's "release date unknown"
_DEFAULT_LIMIT, _MAX_LIMIT = 20, 1000  # Anthropic's page sizes


def openai_card(policy: TrafficPolicy, name: str) -> dict:
    card: dict = {"id": name, "object": "model", "created": 0, "owned_by": "forge"}
    window = policy.served_window(name)
    if window is not None:
        card["max_model_len"] = window
    adapter = policy.adapters.get(name)
    if adapter is not None:
        card["parent"] = adapter[0]
    return card


def anthropic_card(policy: TrafficPolicy, name: str) -> dict:
    card: dict = {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": _EPOCH,
        "lifecycle": "active",
    }
    window = policy.served_window(name)
    if window is not None:
        # A prompt may fill the window, and so may an answer: the engine cuts ``max_tokens`` to
        # what the prompt leaves, as Forge cuts an Anthropic client's to the window.
        card["max_input_tokens"] = card["max_tokens"] = window
    return card


def anthropic_page(cards: list[dict], query: Mapping[str, str]) -> dict:
    """One page of ``cards`` by Anthropic's cursors: ``after_id`` or ``before_id`` (an id the
    list holds) and ``limit``; ``has_more`` says whether the list goes on that way."""
    limit = _limit(query.get("limit"))
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise errors.invalid_request("Give after_id or before_id, not both.", param="after_id")
    ids = [c["id"] for c in cards]
    if before is not None:
        end = _position(ids, before, "before_id")
        page, more = cards[max(0, end - limit) : end], end > limit
    else:
        start = _position(ids, after, "after_id") + 1 if after is not None else 0
        page, more = cards[start : start + limit], start + limit < len(cards)
    return {
        "data": page,
        "has_more": more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


def _limit(value: str | None) -> int:
    if value is None:
        return _DEFAULT_LIMIT
    try:
        limit = int(value)
    except ValueError:
        limit = 0
    if not 1 <= limit <= _MAX_LIMIT:
        raise errors.invalid_request(
            f"limit must be an integer from 1 to {_MAX_LIMIT}.", param="limit"
        )
    return limit


def _position(ids: list[str], cursor: str, param: str) -> int:
    try:
        return ids.index(cursor)
    except ValueError:
        raise errors.invalid_request(f"No model with id {cursor!r}.", param=param) from None
