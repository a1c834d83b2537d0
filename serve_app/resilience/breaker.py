"""A circuit breaker: closed → open after failures → half-open after a cool-down → one probe.

Pure (no Ray, no I/O, the clock passed in), so the state machine is tested without a cluster and
the ``BreakerBoard`` that shares it between gateway replicas is a thin owner around it.

Only failures of the backend count (5xx, transport errors, timeouts): a 4xx says the backend is
up and answering, so while half-open it *resolves* the probe as a success. A request that ends
without a verdict (the client left) releases the probe, so the next request may probe at once;
a probe whose verdict never arrives (its gateway died) is released after ``probe_timeout_s``.
Either way the breaker can never wedge half-open with its one probe slot taken.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass


class State(enum.IntEnum):
    """The value of ``forge_breaker_state``: higher is worse."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class Outcome(enum.Enum):
    SUCCESS = "success"  # the backend answered (4xx included)
    FAILURE = "failure"  # 5xx, transport error, timeout
    NEUTRAL = "neutral"  # no verdict: cancelled by the client, shed before reaching it


class Admit(enum.Enum):
    PASS = "pass"  # closed: go ahead
    PROBE = "probe"  # half-open: this request is the one probe; report its outcome as a probe
    DENY = "deny"  # open (or the probe is out): route around


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    failure_threshold: int = 5  # consecutive failures that open it
    failure_ratio: float = 0.5  # ... or this share of failures over the window
    window_s: float = 10.0
    min_requests: int = 20  # the ratio only counts with at least this many outcomes
    cooldown_s: float = 5.0  # open → half-open
    probe_timeout_s: float = 30.0  # an unanswered probe is released after this


class Breaker:
    _BUCKETS = 10

    def __init__(self, settings: BreakerSettings, now: float) -> None:
        self.settings = settings
        self.state = State.CLOSED
        self.opened_at = now
        self.consecutive_failures = 0
        self.probe_out_until: float | None = None  # set while half-open with its probe out
        # The failure-ratio window in buckets: (bucket start, successes, failures).
        self._window: deque[list[float]] = deque()
        self.transitions = 0
        self.probes = 0  # granted, ever: one per half-open period unless a probe went unanswered
        self.recent_periods: deque[int] = deque(maxlen=20)  # probes granted per half-open period
        self.adopted = False  # rebuilt from a gateway's copy (``BreakerBoard``), not seen failing

    # -- decisions ---------------------------------------------------------------------------

    def admit(self, now: float) -> Admit:
        if self.state is State.CLOSED:
            return Admit.PASS
        if self.state is State.OPEN:
            if now < self.opened_at + self.settings.cooldown_s:
                return Admit.DENY
            self._to(State.HALF_OPEN, now)
        if self.probe_out_until is not None and now < self.probe_out_until:
            return Admit.DENY
        self.probe_out_until = now + self.settings.probe_timeout_s
        self.probes += 1
        self.recent_periods[-1] += 1
        return Admit.PROBE

    def cooldown_left(self, now: float) -> float:
        """Seconds until an open breaker lets a probe try (0 when one may try now)."""
        if self.state is State.OPEN:
            return max(0.0, self.opened_at + self.settings.cooldown_s - now)
        if self.state is State.HALF_OPEN and self.probe_out_until is not None:
            return max(0.0, self.probe_out_until - now)
        return 0.0

    # -- outcomes ----------------------------------------------------------------------------

    def record(self, outcome: Outcome, now: float, *, probe: bool = False, count: int = 1) -> None:
        """``count`` outcomes in a row (gateways send successes summed)."""
        if probe:
            self._resolve_probe(outcome, now)
        elif self.state is State.CLOSED and outcome is Outcome.SUCCESS:
            self._count(outcome, now, count)
        elif self.state is State.CLOSED:
            for _ in range(count):
                self._count(outcome, now)
        # Open or half-open, a non-probe outcome is stale (started before the breaker opened).

    def resume_open(self, now: float, cooldown_left: float) -> None:
        """Open, as a previous owner had it, with ``cooldown_left`` until a probe may try (a
        half-open one is taken as open with none left: the next request probes)."""
        self._to(State.OPEN, now)
        cooldown = self.settings.cooldown_s
        self.opened_at = now + min(cooldown_left, cooldown) - cooldown

    def trip(self, now: float) -> None:
        """Open now, whatever the counts (a pool found at zero replicas is known not to serve)."""
        if self.state is not State.OPEN:
            self._to(State.OPEN, now)

    def _resolve_probe(self, outcome: Outcome, now: float) -> None:
        if self.state is State.CLOSED:
            self._count(outcome, now)  # another gateway's probe already closed it
            return
        if outcome is Outcome.SUCCESS:
            self._to(State.CLOSED, now)
        elif outcome is Outcome.FAILURE:
            self._to(State.OPEN, now)
        else:
            self.probe_out_until = None  # no verdict: the next request may probe

    def _count(self, outcome: Outcome, now: float, successes: int = 1) -> None:
        if outcome is Outcome.NEUTRAL:
            return
        bucket = self._bucket(now)
        if outcome is Outcome.SUCCESS:
            self.consecutive_failures = 0
            bucket[1] += successes
            return
        self.consecutive_failures += 1
        bucket[2] += 1
        s = self.settings
        if self.consecutive_failures >= s.failure_threshold:
            self._to(State.OPEN, now)
            return
        successes = sum(b[1] for b in self._window)
        failures = sum(b[2] for b in self._window)
        total = successes + failures
        if total >= s.min_requests and failures / total >= s.failure_ratio:
            self._to(State.OPEN, now)

    def _bucket(self, now: float) -> list[float]:
        width = self.settings.window_s / self._BUCKETS
        while self._window and self._window[0][0] <= now - self.settings.window_s:
            self._window.popleft()
        if not self._window or now >= self._window[-1][0] + width:
            self._window.append([now, 0, 0])
        return self._window[-1]

    def _to(self, state: State, now: float) -> None:
        self.state = state
        self.transitions += 1
        self.probe_out_until = None
        if state is State.OPEN:
            self.opened_at = now
        elif state is State.HALF_OPEN:
            self.recent_periods.append(0)
        elif state is State.CLOSED:
            self.consecutive_failures = 0
            self._window.clear()
