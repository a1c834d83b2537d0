"""A paced, stamped token source for benchmarks (``SimulatedEngineConfig.paced_tokens_per_s``).

The simulated LLM gives every running sequence its token at the end of one batched step, so
all of a replica's streams emit at the same instant: a gateway in front of it sees bursts of N
frames at once, and its added latency is mostly the burst's own length. A gateway in front of a
fleet sees the streams of many engines, out of step. Here each stream runs on a timer of its
own (its first token as it arrives, then one every ``1 / rate`` seconds on an absolute
schedule), so N streams opened over a ramp are spread evenly over the period.

Each token's text is the engine's ``time.monotonic()`` when it sent it (``~<seconds> ``), the
first one preceded by when the request reached the engine (``@<seconds> ``). CLOCK_MONOTONIC is
one clock for every process of a machine, so a client on the same machine subtracts the
engine's own schedule from its arrival times: what is left is what the path in between added
(``loadtest/concurrency.py``). The text is not a model's; nothing else should use this.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

ARRIVED = "@"  # when the request reached the engine
SENT = "~"  # when the engine sent the token
# One stamp as it appears in a frame's bytes (JSON leaves these characters as they are).
STAMP = re.compile(rb"([@~])(\d+\.\d{6}) ")


def stamp(marker: str, seconds: float) -> str:
    return f"{marker}{seconds:.6f} "


async def paced_tokens(max_tokens: int, rate: float) -> AsyncIterator[tuple[str, bool]]:
    """``max_tokens`` stamped texts, each with whether it is the last."""
    arrived = time.monotonic()
    period = 1.0 / rate
    for index in range(max_tokens):
        delay = arrived + index * period - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        text = stamp(SENT, time.monotonic())
        if index == 0:
            text = stamp(ARRIVED, arrived) + text
        yield text, index + 1 == max_tokens
