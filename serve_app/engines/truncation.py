"""The Responses API's ``truncation: "auto"``: a conversation too long for the model's context
window loses its oldest turns, as OpenAI's API drops items from its start, instead of being
refused with a 400.

Done by the replica, with its engine's own count of the prompt (the model's tokenizer and chat
template: the gateway's count is an estimate) against its own window, so a pool whose window
no config states truncates as exactly as one whose does. The gateway asks for it in the chat
body under ``TRUNCATE_KEY``, which no client may set and no other backend sees.

What goes: whole turns, from the oldest, each a user message and what answered it (the
assistant's text, its tool calls and their results together, which a chat template needs in
one piece); the system messages at the start and the last turn always stay. Room is left for
the answer: its ``max_tokens`` (else the engine's default), at most half the window.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

TRUNCATE_KEY = "forge_truncation"  # "auto": set by the gateway's Responses dialect only


async def fit_conversation(
    body: dict, window: int, default_max_tokens: int, count: Callable[[dict], Awaitable[int]]
) -> dict:
    """``body`` without the gateway's key, and with its oldest turns dropped where its prompt
    (``count``) leaves less than the answer's room in ``window``."""
    wanted = body.get(TRUNCATE_KEY)
    body = {k: v for k, v in body.items() if k != TRUNCATE_KEY}
    messages = body.get("messages")
    if wanted != "auto" or not isinstance(messages, list):
        return body
    answer = body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens
    room = window - min(int(answer), window // 2)
    if await count(body) <= room:
        return body
    head, turns = _turns(messages)
    if len(turns) < 2:
        return body  # nothing to drop: the engine refuses it as it would
    # The fewest oldest turns to drop: a binary search, each probe one count of the prompt.
    low, high = 1, len(turns) - 1
    while low < high:
        middle = (low + high) // 2
        if await count(_kept(body, head, turns[middle:])) <= room:
            high = middle
        else:
            low = middle + 1
    return _kept(body, head, turns[low:])


def _turns(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """The leading system messages, and the rest cut where each user message begins."""
    start = 0
    while start < len(messages) and _role(messages[start]) in ("system", "developer"):
        start += 1
    turns: list[list[dict]] = []
    for message in messages[start:]:
        if not turns or _role(message) == "user":
            turns.append([])
        turns[-1].append(message)
    return messages[:start], turns


def _kept(body: dict, head: list[dict], turns: list[list[dict]]) -> dict:
    return {**body, "messages": [*head, *(m for turn in turns for m in turn)]}


def _role(message: object) -> object:
    return message.get("role") if isinstance(message, dict) else None
