"""The simulator's log-probabilities, in vLLM's shapes, for clients that ask for them.

The simulated model has no distribution, so each token's is made up, deterministically from the
token and its position: the token generated is always the likeliest (its log-probability in
(-1.5, 0]), and the alternatives are words from a fixed list, each less likely than the one
before. What a client reads is what vLLM writes:

- chat (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [the token itself, then k - 1 alternatives]}]}``;
- completions (``logprobs: k``): ``{"text_offset", "token_logprobs", "tokens", "top_logprobs":
  [{token: logprob}, k + 1 of them]}``, offsets running on across a stream's chunks.

vLLM refuses more than its ``--max-logprobs`` (20 by default), and so does the simulator, in its
words.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from serve_app import errors
from serve_app.engines.base import Kind

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
_ALTERNATIVES = (
    " the", " a", ",", ".", " and", " of", " to", " in", " is", " that", " it", " for",
    " on", " with", " as", " was", " be", " this", " by", " not", " or", " are",
)  # fmt: skip


def asked(body: dict, kind: Kind) -> int | None:
    """How many alternatives per token the request asks for, or None where it asks for no
    log-probabilities; more than vLLM gives is its 400."""
    if kind == "chat":
        if not body.get("logprobs"):
            return None
        top = body.get("top_logprobs") or 0
    else:
        top = body.get("logprobs")
        if top is None or top is False:
            return None
    if top == -1 or int(top) > MAX_LOGPROBS:  # -1: the whole vocabulary
        raise errors.invalid_request(
            f"Requested sample logprobs of {top}, which is greater than max allowed: "
            f"{MAX_LOGPROBS}",
            param="top_logprobs" if kind == "chat" else "logprobs",
        )
    return int(top)


def _logprob(token: str, position: int) -> float:
    """The generated token's: in (-1.5, 0], the same for the same token at the same place."""
    spread = zlib.crc32(f"{position}\x00{token}".encode()) % 1500
    return -round(spread / 1000, 4)


def _top(token: str, position: int, count: int) -> list[tuple[str, float]]:
    """The token and ``count - 1`` alternatives, likeliest first."""
    chosen = _logprob(token, position)
    out = [(token, chosen)]
    start = zlib.crc32(f"{position}".encode()) % len(_ALTERNATIVES)
    step = 0
    while len(out) < count and step < len(_ALTERNATIVES):
        other = _ALTERNATIVES[(start + step) % len(_ALTERNATIVES)]
        step += 1
        if other != token:
            out.append((other, round(chosen - 1.0 - 0.75 * len(out), 4)))
    return out


class Logprobs:
    """One request's log-probabilities, a chunk (or a whole answer) at a time."""

    def __init__(self, kind: Kind, top: int) -> None:
        self.kind = kind
        self.top = top
        self.position = 0  # tokens described so far
        self.offset = 0  # characters of text so far (completions' ``text_offset``)

    def of(self, tokens: Sequence[str]) -> dict:
        """The log-probabilities of the next ``tokens``, in the request's API's shape."""
        if self.kind == "chat":
            content = []
            for token in tokens:
                top = _top(token, self.position, self.top)
                content.append(
                    {
                        "token": token,
                        "logprob": top[0][1],
                        "bytes": list(token.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": lp, "bytes": list(t.encode())}
                            for t, lp in top[: self.top]
                        ],
                    }
                )
                self.position += 1
            return {"content": content}
        offsets, values, tops = [], [], []
        for token in tokens:
            top = _top(token, self.position, self.top + 1)
            offsets.append(self.offset)
            values.append(top[0][1])
            tops.append(dict(top))
            self.offset += len(token)
            self.position += 1
        return {
            "text_offset": offsets,
            "token_logprobs": values,
            "tokens": list(tokens),
            "top_logprobs": tops,
        }

    @staticmethod
    def merged(parts: Sequence[dict], kind: Kind) -> dict:
        """A whole answer's, from its chunks'."""
        if kind == "chat":
            return {"content": [entry for part in parts for entry in part["content"]]}
        keys = ("text_offset", "token_logprobs", "tokens", "top_logprobs")
        return {key: [v for part in parts for v in part[key]] for key in keys}
