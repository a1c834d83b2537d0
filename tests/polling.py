"""Wait for a condition, not for a guess at how long it takes.

A fixed sleep is either too short on a busy machine (a flaky test) or too long everywhere else
(a slow suite), and when it is too short the failure names the wrong thing. ``eventually``
polls what the test can observe (a breaker state, a metric, a replica's stats) until it holds,
and when it never does the failure says what was awaited.

``loadtest.inprocess.wait_ready`` is the same idea for one condition (``/readyz``), shared with
the drills; this is the general form, for tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def eventually(
    condition: Callable[[], T],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
    explain: Callable[[], object] | None = None,
) -> T:
    """Call ``condition`` until it returns something truthy, and return that.

    ``condition`` is checked once more after the deadline, so a slow poll never fails a
    condition that holds. Past it, an ``AssertionError`` names ``what`` was awaited and, if
    given, what ``explain()`` shows then (the state that did not get there).
    """
    for _ in _until(timeout_s, what, explain):
        if result := condition():
            return result
        time.sleep(interval_s)
    raise AssertionError("unreachable")


async def eventually_async(
    condition: Callable[[], T],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.01,
    explain: Callable[[], object] | None = None,
) -> T:
    """``eventually`` inside an event loop: polls without blocking the tasks it waits for."""
    for _ in _until(timeout_s, what, explain):
        if result := condition():
            return result
        await asyncio.sleep(interval_s)
    raise AssertionError("unreachable")


def _until(timeout_s: float, what: str, explain: Callable[[], object] | None) -> Iterator[None]:
    """Yields once per poll; once the deadline has passed and the last poll failed, raises."""
    deadline = time.monotonic() + timeout_s
    while True:
        yield
        if time.monotonic() >= deadline:
            detail = f"; last seen: {explain()!r}" if explain is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{detail}")
