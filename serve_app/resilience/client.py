"""A gateway replica's view of the shared breakers: local reads, batched reports.

Reading a state is a dict lookup: a healthy request path never waits on the board. Outcomes
queue up and go to the board in one call per ``sync_interval_s``, which also brings back every
non-closed state; a failure or a probe's verdict is sent at once instead, so the board opens a
breaker on the N-th failure fleet-wide within one round trip of it.

A replica that itself sees ``trip_after`` consecutive failures of a backend opens its own copy at
once, without waiting for the board's answer: the failures that arrive during that round trip
would each need a retry, and the retry budget's floor is sized for the failures it takes to open
a breaker, not for the board's latency too (the eval gate's failover drill saw 4 clients get a 502
at 6 req/s before this). The board's next snapshot is the truth again: it opened too (it has the
same failures) or, if other replicas' successes outweigh them, it closes the local copy.

The staleness accepted: another gateway replica hears of an open breaker up to
``sync_interval_s`` (0.5 s by default) late. Meanwhile its requests to the dead backend fail
before their first byte and are retried within the retry budget, so the cost is a few retries,
never an error a client sees; syncing faster would cost a board round trip per interval for
every gateway replica forever, for an outage that happens rarely.

If the board cannot be reached the client keeps its last copy and lets requests through
(breakers are an optimisation; the retry budget still bounds the damage), and counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from serve_app.resilience.board import BoardPort, Report, Snapshot
from serve_app.resilience.breaker import Admit, Outcome, State

logger = logging.getLogger("ray.serve")

_BOARD_TIMEOUT_S = 2.0


class BreakerClient:
    def __init__(
        self,
        board: BoardPort | None,
        sync_interval_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
        on_board_error: Callable[[str], None] | None = None,
        *,
        trip_after: int | None = None,
        local_open_s: float = 1.0,
    ) -> None:
        self._board = board
        self._trip_after = trip_after
        self._local_open_s = local_open_s
        self._streaks: dict[str, int] = {}  # backend → consecutive failures seen here
        self._last_failure: dict[str, float] = {}  # backend → when the streak last grew
        self._interval = sync_interval_s
        self._clock = clock
        self._on_board_error = on_board_error
        self._states: dict[str, tuple[State, float]] = {}  # backend → (state, probe may try at)
        self._told: dict[str, tuple[State, float]] = {}  # the board's own word, local opens aside
        self._pending: list[Report] = []
        # Plain successes since each backend's last other report: sent as one count, after it.
        self._successes: dict[str, int] = {}
        self._urgent = asyncio.Event()
        self._asking: set[str] = set()  # probe grants being asked for from this replica
        self._task: asyncio.Task | None = None
        self._closed = False

    def configure(self, *, trip_after: int | None, local_open_s: float) -> None:
        """A live change of the breaker settings, for this replica's own early copies."""
        self._trip_after = trip_after
        self._local_open_s = local_open_s

    async def configure_board(self, settings: dict) -> None:
        """Pass a live change of the breaker settings on to the board (every breaker there)."""
        if self._board is not None:
            await self._board.configure(settings)

    # -- reads (the request path) ------------------------------------------------------------

    def state(self, backend: str) -> State:
        entry = self._states.get(backend)
        return State.CLOSED if entry is None else entry[0]

    def probe_ready(self, backend: str) -> bool:
        """Not closed, but its cool-down is over: a request may ask the board for the probe."""
        entry = self._states.get(backend)
        return entry is not None and self._clock() >= entry[1]

    def retry_after(self, backend: str) -> float:
        entry = self._states.get(backend)
        return 0.0 if entry is None else max(0.0, entry[1] - self._clock())

    async def admit(self, backend: str) -> Admit:
        """PASS while closed (no round trip); past an open breaker's cool-down, ask the board."""
        self._ensure_running()
        entry = self._states.get(backend)
        if entry is None:
            return Admit.PASS
        if self._clock() < entry[1] or backend in self._asking or self._board is None:
            return Admit.DENY
        self._asking.add(backend)
        try:
            decision, snapshot = await asyncio.wait_for(
                self._board.admit(backend), _BOARD_TIMEOUT_S
            )
        except Exception as exc:  # board unreachable: let it through, the budget still holds
            self._board_error("admit", exc)
            return Admit.PASS
        finally:
            self._asking.discard(backend)
        self._apply(snapshot)
        return Admit(decision)

    # -- reports -----------------------------------------------------------------------------

    def now(self) -> float:
        """This client's clock: what ``record``'s ``sent_at`` is measured on."""
        return self._clock()

    def record(
        self, backend: str, outcome: Outcome, *, probe: bool = False, sent_at: float | None = None
    ) -> None:
        """Queue an outcome. A healthy request costs a counter bump: successes are summed per
        backend (order kept: they are sent before the backend's next other report), and a
        neutral outcome that is no probe changes nothing on the board, so it is not sent.

        ``sent_at`` (``now()`` when the attempt was sent): a success of a request sent before
        the backend's latest failure is old news, neutral here and on the board; the streams
        that were running when a backend died end well for a while after it died, and counted
        as successes they would keep resetting its consecutive failures (the gate's failover
        drill: 3 of 146 clients got a 502 before the breakers opened, past the retry budget).
        """
        self._ensure_running()
        if not probe:
            if outcome is Outcome.SUCCESS:
                failed_at = self._last_failure.get(backend)
                if failed_at is not None and sent_at is not None and sent_at < failed_at:
                    return
                self._streaks.pop(backend, None)
                self._last_failure.pop(backend, None)  # news: the backend works again
                self._successes[backend] = self._successes.get(backend, 0) + 1
                return
            if outcome is Outcome.NEUTRAL:
                return
            self._count_failure(backend)
        self._report(backend, outcome.value, probe)
        self._urgent.set()

    def _count_failure(self, backend: str) -> None:
        self._last_failure[backend] = self._clock()
        streak = self._streaks[backend] = self._streaks.get(backend, 0) + 1
        if self._trip_after is not None and streak >= self._trip_after:
            # Open here now; the board's snapshot (with these same failures) follows.
            self._states.setdefault(backend, (State.OPEN, self._clock() + self._local_open_s))

    def _report(self, backend: str, what: str, probe: bool) -> None:
        successes = self._successes.pop(backend, 0)
        if successes:
            self._pending.append((backend, Outcome.SUCCESS.value, False, successes))
        self._pending.append((backend, what, probe, 1))

    def trip(self, backend: str) -> None:
        """Open a breaker now (a pool found at zero replicas), fleet-wide."""
        self._ensure_running()
        self._report(backend, "trip", False)
        self._urgent.set()
        # Locally at once, so the very next request routes around it too.
        self._states.setdefault(backend, (State.OPEN, self._clock() + 1.0))

    async def flush(self) -> None:
        """Send what is queued; take the board's states back."""
        if self._board is None:
            return
        reports, self._pending = self._pending, []
        reports += [(b, Outcome.SUCCESS.value, False, n) for b, n in self._successes.items()]
        self._successes = {}
        now = self._clock()
        held = {b: (int(state), max(0.0, at - now)) for b, (state, at) in self._told.items()}
        try:
            snapshot = await asyncio.wait_for(self._board.sync(reports, held), _BOARD_TIMEOUT_S)
        except Exception as exc:
            self._board_error("sync", exc)
            return  # the reports are dropped: stale outcomes are worth less than a hung queue
        self._apply(snapshot)

    # -- operators ---------------------------------------------------------------------------

    async def describe(self) -> dict[str, dict]:
        """The board's view of every breaker (``BreakerBoard.describe``); raises when the board
        cannot be reached (an operator must not mistake "unknown" for "all closed")."""
        if self._board is None:
            return {}
        return await asyncio.wait_for(self._board.describe(), _BOARD_TIMEOUT_S)

    async def reset(self, backend: str | None = None) -> dict[str, dict]:
        """Close one breaker on the board, or all, and take its states at once: this replica
        routes to the backend from the next request, not the next sync. Other replicas hear
        of it on their next sync. Returns the board's new ``describe``.

        The states taken here are kept fresh like any: a replica that served no request yet has
        no sync running, and would hold the board's other open breakers forever (CI saw one
        still open 10 s after the board closed it, on the replica an admin reset reached)."""
        if self._board is None:
            return {}
        self._ensure_running()
        snapshot = await asyncio.wait_for(self._board.reset(backend), _BOARD_TIMEOUT_S)
        self._apply(snapshot)
        return await self.describe()

    def _apply(self, snapshot: Snapshot) -> None:
        now = self._clock()
        # The board's word on a backend ends the local streak; its absence does not.
        self._streaks = {b: n for b, n in self._streaks.items() if b not in snapshot}
        self._states = {
            backend: (State(state), now + cooldown_left)
            for backend, (state, cooldown_left) in snapshot.items()
        }
        self._told = dict(self._states)

    # -- background sync ---------------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self._task is None and self._board is not None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._urgent.wait(), self._interval)
            self._urgent.clear()
            try:
                await self.flush()
            except Exception:  # never let the sync loop die
                logger.exception("breaker sync failed")

    def _board_error(self, op: str, exc: BaseException) -> None:
        logger.warning("breaker board %s failed: %s", op, type(exc).__name__)
        if self._on_board_error is not None:
            self._on_board_error(op)

    async def aclose(self) -> None:
        """Stop the sync loop. A cancel that lands as one of its ``wait_for`` calls completes
        is swallowed on Python 3.11, so the loop also checks ``_closed`` and is cancelled again
        until it is done."""
        self._closed = True
        task, self._task = self._task, None
        while task is not None and not task.done():
            task.cancel()
            self._urgent.set()
            await asyncio.wait([task], timeout=0.1)
