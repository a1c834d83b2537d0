"""The retry budget: retries stay under a share of requests over a sliding window.

A retry doubles the work of a request that already failed once; when a backend fails wholesale,
unbounded retries double the load exactly when it can least take it. The budget caps retries at
``ratio`` of the requests seen over the window, with a small floor so that a quiet gateway can
still retry its rare failure. Per gateway replica: each replica sees its share of the requests
and of the retries, so the fleet-wide ratio holds without a shared counter on the request path.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryBudgetSettings:
    ratio: float = 0.1
    window_s: float = 10.0
    min_retries: int = 3  # per window, whatever the traffic


class RetryBudget:
    def __init__(self, settings: RetryBudgetSettings) -> None:
        self.settings = settings
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def on_request(self, now: float) -> None:
        self._requests.append(now)
        self._expire(now)  # amortised O(1); keeps the window's memory bounded

    def try_spend(self, now: float) -> bool:
        """Whether one more retry fits; spends it if so."""
        self._expire(now)
        if len(self._retries) + 1 > self.allowed(now):
            return False
        self._retries.append(now)
        return True

    def allowed(self, now: float) -> float:
        self._expire(now)
        return max(self.settings.min_retries, self.settings.ratio * len(self._requests))

    def used(self, now: float) -> int:
        self._expire(now)
        return len(self._retries)

    def _expire(self, now: float) -> None:
        horizon = now - self.settings.window_s
        for q in (self._requests, self._retries):
            while q and q[0] <= horizon:
                q.popleft()
