"""The ``BreakerBoard``: the one owner of every breaker, shared by all gateway replicas.

Gateway replicas never ask it on the request path while a backend is healthy: each keeps a copy
of the states (``BreakerClient``) and sends outcomes in batches. Two things do go to the board
at once, because they must be decided once for the whole fleet: a failure (so the breaker opens
after the N-th failure anywhere, not after N per replica) and a half-open probe grant (exactly
one probe, fleet-wide). It runs as a one-replica Serve deployment, like a pool's scheduler.

A new board (a restart, a redeploy of its application) is rebuilt from the gateways: each sync
carries the states the board last told that replica, and for ``ADOPT_S`` after its start the
board takes a state it has no breaker for, cool-down left included. So an open breaker stays
open across a board's replacement instead of letting a dead backend's traffic through again.
A reset ends the adoption (the gateways' copies are older than the operator's word).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from serve_app.resilience.breaker import Admit, Breaker, BreakerSettings, Outcome, State

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

# What a gateway replica reports: (backend, outcome value or "trip", whether it was a probe,
# how many in a row). Successes arrive summed per backend, so the board's work per sync is
# per backend, not per request.
Report = tuple[str, str, bool, int]
# What it gets back per backend: (state, seconds until a probe may try).
Snapshot = dict[str, tuple[int, float]]


class BoardPort(Protocol):
    """What a gateway replica's ``BreakerClient`` asks of the board. ``BreakerBoard`` is the
    in-process implementation; ``ServeBoard`` reaches the one board deployment by handle."""

    async def sync(self, reports: Iterable[Report], held: Snapshot | None = None) -> Snapshot:
        """Apply outcomes in order; every non-closed state back. ``held``: the states the
        board last sent this caller, which a new board takes on (see the module docstring)."""
        ...

    async def admit(self, backend: str) -> tuple[str, Snapshot]:
        """The probe decision (an ``Admit`` value) for a backend past its cool-down."""
        ...

    async def describe(self) -> dict[str, dict]:
        """Every breaker the board knows, for operators (``GET /admin/breakers``)."""
        ...

    async def reset(self, backend: str | None = None) -> Snapshot:
        """Close one breaker, or all; every non-closed state back."""
        ...

    async def configure(self, settings: dict) -> None:
        """A live change of the breaker settings; every breaker keeps its state."""
        ...


_FORGET_AFTER_S = 600.0  # a replica's breaker nobody reported on for this long is gone
BOARD_DEPLOYMENT = "breaker-board"
ADOPT_S = 10.0  # a new board takes the gateways' states for this long (they sync every 0.5 s)
_REPUBLISH_S = 2.0  # each state gauge set again this often: well inside Ray's export window


class BreakerBoard:
    def __init__(
        self,
        settings: dict | BreakerSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: BoardMetrics | None = None,
    ) -> None:
        if isinstance(settings, dict):
            settings = BreakerSettings(**settings)
        self.settings = settings or BreakerSettings()
        self._clock = clock
        self._breakers: dict[str, Breaker] = {}
        self._touched: dict[str, float] = {}
        self._metrics = metrics
        self._adopt_until = clock() + ADOPT_S
        self._republished = float("-inf")

    async def configure(self, settings: dict) -> None:
        """New thresholds, windows and cool-downs for every breaker, now and to come: an open
        breaker stays open (its cool-down measured with the new setting), counts are kept."""
        self.settings = BreakerSettings(**settings)
        for breaker in self._breakers.values():
            breaker.settings = self.settings

    def breaker(self, backend: str) -> Breaker:
        breaker = self._breakers.get(backend)
        if breaker is None:
            breaker = self._breakers[backend] = Breaker(self.settings, self._clock())
            self._publish(backend, breaker)
        return breaker

    async def sync(self, reports: Iterable[Report] = (), held: Snapshot | None = None) -> Snapshot:
        """Apply a gateway replica's outcomes in the order it saw them; return every state."""
        now = self._clock()
        if held and now < self._adopt_until:
            self._adopt(held, now)
        for backend, outcome, probe, count in reports:
            breaker = self.breaker(backend)
            before = breaker.state
            if outcome == "trip":
                breaker.trip(now)
            else:
                breaker.record(Outcome(outcome), now, probe=probe, count=count)
            self._touched[backend] = now
            if breaker.state is not before:
                self._publish(backend, breaker, transition=True)
        self._forget(now)
        self._republish(now)
        return self.snapshot()

    def _republish(self, now: float) -> None:
        """Every breaker's state again, every few seconds (the gateways' syncs drive it): Ray's
        metrics export drops a gauge nobody set for two export periods, so a breaker that stays
        open with no traffic would vanish from the dashboard, and ``ForgeBreakerOpen``, whose
        ``for: 1m`` needs the series present throughout, would never fire."""
        if self._metrics is None or now - self._republished < _REPUBLISH_S:
            return
        self._republished = now
        for name, breaker in self._breakers.items():
            self._publish(name, breaker)

    async def admit(self, backend: str) -> tuple[str, Snapshot]:
        """Decide for a backend whose cool-down is over: the first caller gets the probe."""
        breaker = self.breaker(backend)
        before = breaker.state
        decision = breaker.admit(self._clock())
        if breaker.state is not before:
            self._publish(backend, breaker, transition=True)
        if decision is Admit.PROBE and self._metrics is not None:
            self._metrics.probes.inc(tags={"backend": backend})
        return decision.value, self.snapshot()

    def _adopt(self, held: Snapshot, now: float) -> None:
        for backend, (state, cooldown_left) in held.items():
            if backend in self._breakers or State(state) is State.CLOSED:
                continue
            breaker = self._breakers[backend] = Breaker(self.settings, now)
            breaker.resume_open(now, cooldown_left)
            breaker.adopted = True
            self._touched[backend] = now
            self._publish(backend, breaker, transition=True)

    async def reset(self, backend: str | None = None) -> Snapshot:
        """Close one breaker, or all (an operator who knows better; a test between drills)."""
        self._adopt_until = 0.0
        for name in [backend] if backend else list(self._breakers):
            breaker = self._breakers.pop(name, None)
            if breaker is not None and breaker.state is not State.CLOSED and self._metrics:
                self._metrics.state.set(0, tags={"backend": name})
                self._metrics.transitions.inc(tags={"backend": name, "to": "closed"})
        return self.snapshot()

    async def describe(self) -> dict[str, dict]:
        """Every breaker the board knows, for operators and drills."""
        now = self._clock()
        return {
            name: {
                "state": b.state.name.lower(),
                "retry_in_s": round(b.cooldown_left(now), 3),
                "consecutive_failures": b.consecutive_failures,
                "transitions": b.transitions,
                "probes": b.probes,
                "probes_per_half_open": list(b.recent_periods),
                "adopted": b.adopted,  # taken on from a gateway's copy by a new board
            }
            for name, b in sorted(self._breakers.items())
        }

    def snapshot(self) -> Snapshot:
        now = self._clock()
        return {
            name: (int(b.state), b.cooldown_left(now))
            for name, b in self._breakers.items()
            if b.state is not State.CLOSED
        }

    def _forget(self, now: float) -> None:
        stale = [
            name
            for name, at in self._touched.items()
            if "/" in name and now - at > _FORGET_AFTER_S  # only replicas come and go
        ]
        for name in stale:
            self._touched.pop(name, None)
            breaker = self._breakers.pop(name, None)
            if breaker is not None and breaker.state is not State.CLOSED and self._metrics:
                # A replica gone with its breaker open must not keep an alert firing for ever.
                self._metrics.state.set(0, tags={"backend": name})

    def _publish(self, backend: str, breaker: Breaker, *, transition: bool = False) -> None:
        if self._metrics is None:
            return
        self._metrics.state.set(int(breaker.state), tags={"backend": backend})
        if transition:
            self._metrics.transitions.inc(
                tags={"backend": backend, "to": breaker.state.name.lower()}
            )


class BoardMetrics:
    """The board's series: one writer, so a backend's state is one series, not one per gateway."""

    def __init__(self) -> None:
        from serve_app.metrics import counter, gauge

        self.state = gauge(
            "forge_breaker_state",
            "Circuit breaker state per backend: 0 closed, 1 half-open, 2 open.",
            "backend",
        )
        self.transitions = counter(
            "forge_breaker_transitions_total",
            "Circuit breaker transitions per backend, by the state entered.",
            *("backend", "to"),
        )
        self.probes = counter(
            "forge_breaker_probes_total",
            "Half-open probes let through, per backend (one per half-open period).",
            "backend",
        )


class BreakerBoardDeployment(BreakerBoard):
    """The Serve deployment class (``app.py`` binds it with the config's breaker settings, or
    none in the control application: the gateways send theirs, ``configure``)."""

    def __init__(self, settings: dict | None = None, *_schedulers: DeploymentHandle) -> None:
        # ``_schedulers``: the control application's, bound here so that they deploy with it.
        super().__init__(settings, metrics=BoardMetrics())


class ServeBoard:
    """``BoardPort`` over the ``breaker-board`` deployment's handle."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle

    async def sync(self, reports: Iterable[Report], held: Snapshot | None = None) -> Snapshot:
        return await self._handle.sync.remote(list(reports), held)

    async def admit(self, backend: str) -> tuple[str, Snapshot]:
        return await self._handle.admit.remote(backend)

    async def describe(self) -> dict[str, dict]:
        return await self._handle.describe.remote()

    async def reset(self, backend: str | None = None) -> Snapshot:
        return await self._handle.reset.remote(backend)

    async def configure(self, settings: dict) -> None:
        await self._handle.configure.remote(settings)
