"""The fallback's health watch: probed from start-up on a timer, not on the first /readyz; a
failed probe counts against the backend's breaker; /readyz reads the last answer."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.resilience.board import BreakerBoard
from serve_app.resilience.breaker import BreakerSettings, State
from serve_app.resilience.client import BreakerClient
from serve_app.resilience.health import HealthWatch
from tests.polling import eventually_async

LONG_S = 3600.0  # an interval no test outlives: only the immediate probe happens
TICK_S = 0.01


class Check:
    """The backend's health endpoint: answers ``up`` (or raises ``error``), counting calls."""

    def __init__(self, up: bool = True, error: Exception | None = None) -> None:
        self.up = up
        self.error = error
        self.calls = 0

    async def __call__(self) -> bool:
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.up


@pytest.fixture
def board() -> BreakerBoard:
    return BreakerBoard(BreakerSettings(failure_threshold=2, cooldown_s=30))


@pytest.fixture
async def breakers(board: BreakerBoard):
    client = BreakerClient(board, sync_interval_s=60)
    yield client
    await client.aclose()


@pytest.fixture
async def watches():
    """Every watch a test starts is closed after it, whatever the test did."""
    started: list[HealthWatch] = []

    def make(check: Check, interval_s: float, breakers: BreakerClient | None = None):
        watch = HealthWatch("fallback", check, interval_s, breakers)
        started.append(watch)
        return watch

    yield make
    for watch in started:
        await watch.aclose()


async def test_start_probes_at_once_without_anyone_asking(watches):
    """Regression: the timer used to start on the first /readyz, so an idle dead fallback was
    not found until a readiness probe happened to ask."""
    check = Check(up=True)
    watch = watches(check, LONG_S)
    watch.start()
    await eventually_async(lambda: check.calls == 1, timeout_s=5, what="the first probe")
    assert watch.healthy is True


async def test_then_probes_every_interval(watches):
    check = Check(up=True)
    watch = watches(check, TICK_S)
    watch.start()
    await eventually_async(lambda: check.calls >= 3, timeout_s=5, what="three probes")


async def test_current_returns_the_last_answer_without_probing(watches):
    check = Check(up=True)
    watch = watches(check, LONG_S)
    watch.start()
    await eventually_async(lambda: check.calls == 1, timeout_s=5, what="the first probe")

    check.up = False  # the backend died since: /readyz still reports the last probe
    assert [await watch.current() for _ in range(5)] == [True] * 5
    assert check.calls == 1


async def test_current_probes_once_when_there_is_no_answer_yet(watches):
    check = Check(up=False)
    watch = watches(check, LONG_S)  # never started
    assert await watch.current() is False
    assert await watch.current() is False
    assert check.calls == 1


async def started(watches, check: Check, breakers: BreakerClient) -> HealthWatch:
    """A watch started, its first probe answered and reported to the board."""
    watch = watches(check, LONG_S, breakers)
    watch.start()
    await eventually_async(lambda: check.calls == 1, timeout_s=5, what="the first probe")
    await breakers.flush()
    return watch


async def test_a_failed_probe_counts_against_the_backends_breaker(watches, breakers, board):
    watch = await started(watches, Check(up=False), breakers)
    assert (await board.describe())["fallback"]["consecutive_failures"] == 1

    await watch.probe()  # the second failure opens it (threshold 2), fleet-wide
    await breakers.flush()
    assert board.breaker("fallback").state is State.OPEN
    assert breakers.state("fallback") is State.OPEN


async def test_a_passing_probe_counts_nothing(watches, breakers, board):
    await started(watches, Check(up=True), breakers)
    assert "fallback" not in await board.describe()


async def test_a_check_that_raises_counts_as_down(watches, breakers, board):
    check = Check(error=ConnectionError("connection refused"))
    watch = watches(check, LONG_S, breakers)
    watch.start()
    await eventually_async(lambda: watch.healthy is False, timeout_s=5, what="a down answer")
    assert await watch.current() is False
    await breakers.flush()
    assert (await board.describe())["fallback"]["consecutive_failures"] == 1


async def test_aclose_stops_the_timer(watches):
    check = Check(up=True)
    watch = watches(check, TICK_S)
    watch.start()
    await eventually_async(lambda: check.calls >= 2, timeout_s=5, what="two probes")
    await watch.aclose()

    assert not [t for t in asyncio.all_tasks() if "HealthWatch._run" in repr(t.get_coro())]

    calls = check.calls
    # A watch on the same interval probes three more times meanwhile: so would a running timer.
    control = Check(up=True)
    watches(control, TICK_S).start()
    await eventually_async(lambda: control.calls >= 4, timeout_s=5, what="the control's probes")
    assert check.calls == calls


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("up", [True, False], ids=["passes", "fails"])
async def test_past_the_cool_down_a_check_is_the_open_breakers_probe(watches, up):
    """An idle fallback's breaker was probed only by a failover's request: open for hours (and
    ForgeBreakerOpen firing) while the fallback was back, until a client's request found out."""
    clock = Clock()
    board = BreakerBoard(BreakerSettings(failure_threshold=2, cooldown_s=30), clock=clock)
    breakers = BreakerClient(board, sync_interval_s=60, clock=clock)
    try:
        check = Check(up=False)
        watch = watches(check, LONG_S, breakers)
        for _ in range(2):
            await watch.probe()
        await breakers.flush()
        assert board.breaker("fallback").state is State.OPEN
        check.up = up
        await watch.probe()  # within the cool-down: no probe, the breaker stays open
        await breakers.flush()
        assert board.breaker("fallback").state is State.OPEN

        clock.now += 31
        await watch.probe()
        await breakers.flush()
        assert board.breaker("fallback").state is (State.CLOSED if up else State.OPEN)
    finally:
        await breakers.aclose()
