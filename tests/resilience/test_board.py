"""The board and the gateway-side client: shared decisions, local reads, batched reports."""

from __future__ import annotations

import asyncio

from serve_app.resilience.board import BreakerBoard
from serve_app.resilience.breaker import Admit, BreakerSettings, Outcome, State
from serve_app.resilience.client import BreakerClient
from tests.doubles import Clock, Counter
from tests.polling import eventually_async

S = BreakerSettings(failure_threshold=3, cooldown_s=5, min_requests=100)


class CountingBoard(BreakerBoard):
    """The in-process board, counting the calls a gateway's client makes to it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    async def sync(self, reports=(), held=None):
        self.calls.append("sync")
        return await super().sync(reports, held)

    async def admit(self, backend):
        self.calls.append("admit")
        return await super().admit(backend)


async def test_failures_from_two_gateways_add_up_on_the_board():
    clock = Clock()
    board = BreakerBoard(S, clock)
    a = BreakerClient(board, sync_interval_s=60, clock=clock)
    b = BreakerClient(board, sync_interval_s=60, clock=clock)
    a.record("primary", Outcome.FAILURE)
    a.record("primary", Outcome.FAILURE)
    b.record("primary", Outcome.FAILURE)
    await a.flush()
    assert board.breaker("primary").state is State.CLOSED  # 2 of 3
    await b.flush()
    assert board.breaker("primary").state is State.OPEN  # the third, from another gateway
    assert b.state("primary") is State.OPEN
    assert a.state("primary") is State.CLOSED  # hears of it on its next sync
    await a.flush()
    assert a.state("primary") is State.OPEN


async def test_a_healthy_path_never_calls_the_board():
    board = CountingBoard(S)
    client = BreakerClient(board, sync_interval_s=60)
    assert [await client.admit("primary") for _ in range(100)] == [Admit.PASS] * 100
    assert board.calls == []


async def test_only_one_gateway_gets_the_probe():
    clock = Clock()
    board = BreakerBoard(S, clock)
    clients = [BreakerClient(board, sync_interval_s=60, clock=clock) for _ in range(3)]
    for _ in range(3):
        clients[0].record("fallback", Outcome.FAILURE)
    await clients[0].flush()
    for c in clients:
        await c.flush()
        assert await c.admit("fallback") is Admit.DENY  # cooling down: no board call needed
    clock.now = 6
    decisions = await asyncio.gather(*(c.admit("fallback") for c in clients))
    assert sorted(d.value for d in decisions) == ["deny", "deny", "probe"]


async def test_the_probe_verdict_closes_it_for_everyone():
    clock = Clock()
    board = BreakerBoard(S, clock)
    a = BreakerClient(board, sync_interval_s=60, clock=clock)
    b = BreakerClient(board, sync_interval_s=60, clock=clock)
    a.trip("primary")
    await a.flush()
    await b.flush()
    clock.now = 6
    assert await b.admit("primary") is Admit.PROBE
    b.record("primary", Outcome.SUCCESS, probe=True)
    await b.flush()
    await a.flush()
    assert a.state("primary") is State.CLOSED and await a.admit("primary") is Admit.PASS


async def test_an_unreachable_board_fails_open_and_is_counted():
    errors: list[str] = []

    class Unreachable:
        async def sync(self, reports, held=None):
            raise ConnectionError("board gone")

        async def admit(self, backend):
            raise ConnectionError("board gone")

    clock = Clock()
    client = BreakerClient(
        Unreachable(), sync_interval_s=60, clock=clock, on_board_error=errors.append
    )
    client.trip("primary")  # known locally at once
    assert client.state("primary") is State.OPEN
    await client.flush()
    clock.now = 2
    assert await client.admit("primary") is Admit.PASS  # cannot ask for a probe: let it through
    assert errors == ["sync", "admit"]


async def test_the_sync_loop_pushes_failures_at_once():
    board = BreakerBoard(S)
    client = BreakerClient(board, sync_interval_s=60)
    await client.admit("x")  # starts the loop
    for _ in range(3):
        client.record("primary", Outcome.FAILURE)
    await eventually_async(  # long before the 60 s interval
        lambda: client.state("primary") is State.OPEN,
        timeout_s=5,
        what="the failures pushed to the board and its verdict back",
        explain=lambda: client.state("primary"),
    )
    await client.aclose()


async def test_a_healthy_path_sends_one_summed_report_per_backend_in_order():
    clock = Clock()
    sent: list = []

    class RecordingBoard(BreakerBoard):
        async def sync(self, reports=(), held=None):
            sent.append(list(reports))
            return await super().sync(reports, held)

    board = RecordingBoard(S, clock)
    client = BreakerClient(board, sync_interval_s=60, clock=clock)
    client.record("primary", Outcome.FAILURE)
    client.record("primary", Outcome.FAILURE)
    for _ in range(500):
        client.record("primary", Outcome.SUCCESS)
        client.record("primary/r1", Outcome.SUCCESS)
        client.record("primary", Outcome.NEUTRAL)  # no verdict, nothing to send
    client.record("primary", Outcome.FAILURE)
    await client.flush()
    assert sent == [
        [
            ("primary", "failure", False, 1),
            ("primary", "failure", False, 1),
            ("primary", "success", False, 500),  # before the failure that followed them
            ("primary", "failure", False, 1),
            ("primary/r1", "success", False, 500),
        ]
    ]
    # The successes reset the streak: 1 failure in a row, not 3.
    assert board.breaker("primary").state is State.CLOSED
    assert board.breaker("primary").consecutive_failures == 1


async def test_closing_right_after_a_report_finishes():
    """Bug: a cancel landing as one of the sync loop's wait_for calls completed was swallowed
    (Python 3.11), so aclose() waited for ever and Gateway.aclose never closed the store."""
    for offset in range(20):  # the window is a few loop ticks wide: cross it at several offsets
        client = BreakerClient(BreakerBoard(S), sync_interval_s=60)
        client.record("fallback", Outcome.FAILURE)  # queued; the sync loop is woken
        for _ in range(offset % 5):
            await asyncio.sleep(0)
        closing = asyncio.get_running_loop().create_task(client.aclose())
        try:
            await eventually_async(closing.done, timeout_s=2, what="the client to close")
        finally:
            closing.cancel()


class Gauges:
    """The board's series, as ``BoardMetrics`` has them, recorded."""

    def __init__(self) -> None:
        self.state, self.transitions, self.probes = Counter(), Counter(), Counter()


async def test_a_replica_forgotten_with_its_breaker_open_is_reported_closed():
    """A replica that died with its breaker open must not keep forge_breaker_state at 2 (and
    its alert firing) for ever after the board forgets it."""

    clock, gauges = Clock(), Gauges()
    board = BreakerBoard(S, clock, metrics=gauges)
    await board.sync([("primary/gone", "trip", False, 1)])
    assert gauges.state.values[-1] == 2
    clock.advance(601)
    await board.sync([("primary", "success", False, 1)])  # any later sync forgets stale ones
    assert "primary/gone" not in await board.describe()
    told = list(zip(gauges.state.calls, gauges.state.values, strict=True))
    assert told[-2:] == [({"backend": "primary/gone"}, 0), ({"backend": "primary"}, 0)]


async def test_a_breaker_open_with_no_traffic_keeps_its_state_gauge_set():
    """Ray's export drops a gauge nobody set for two periods: the board sets every state again
    every few seconds of the gateways' syncs, so an open breaker stays on the dashboard and
    its alert's ``for: 1m`` can run out."""

    clock, gauges = Clock(), Gauges()
    board = BreakerBoard(S, clock, metrics=gauges)
    await board.sync([("primary", "trip", False, 1)])
    set_before = len(gauges.state.values)
    for _ in range(30):  # a minute of syncs with nothing to report, 2 s apart
        clock.advance(2)
        await board.sync()
    opened = gauges.state.values[set_before:]
    assert len(opened) >= 29 and set(opened) == {2}


class SlowBoard(BreakerBoard):
    """A board whose answers are still on their way: what a loaded cluster's round trip is."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.gate = asyncio.Event()

    async def sync(self, reports, held=None):
        await self.gate.wait()
        return await super().sync(reports, held)


async def test_a_gateway_opens_its_own_copy_on_the_failures_that_open_the_board():
    """The requests that fail while the board's answer travels would each need a retry."""
    clock = Clock()
    board = SlowBoard(S, clock)
    client = BreakerClient(board, sync_interval_s=60, clock=clock, trip_after=3, local_open_s=5)
    for _ in range(2):
        client.record("primary", Outcome.FAILURE)
    assert client.state("primary") is State.CLOSED
    client.record("primary", Outcome.FAILURE)
    assert client.state("primary") is State.OPEN  # before the board has heard a thing
    assert await client.admit("primary") is Admit.DENY
    board.gate.set()
    await client.flush()
    assert board.breaker("primary").state is State.OPEN  # the board agrees: same failures
    assert client.state("primary") is State.OPEN


async def test_a_success_between_failures_keeps_the_local_copy_closed():
    client = BreakerClient(BreakerBoard(S), sync_interval_s=60, trip_after=3)
    for outcome in (Outcome.FAILURE, Outcome.FAILURE, Outcome.SUCCESS, Outcome.FAILURE):
        client.record("primary", outcome)
    assert client.state("primary") is State.CLOSED


async def test_the_board_has_the_last_word_over_a_local_trip():
    """Other gateways' successes outweigh this one's failures: the board's snapshot closes it."""
    board = BreakerBoard(BreakerSettings(failure_threshold=10, cooldown_s=5, min_requests=100))
    client = BreakerClient(board, sync_interval_s=60, trip_after=3)
    for _ in range(3):
        client.record("primary", Outcome.FAILURE)
    assert client.state("primary") is State.OPEN
    await client.flush()
    assert client.state("primary") is State.CLOSED


async def test_a_stream_sent_before_the_failures_ends_well_without_ending_the_streak():
    """Streams running when a backend died finish well for a while after it: old news."""
    clock = Clock()
    client = BreakerClient(BreakerBoard(S), sync_interval_s=60, clock=clock, trip_after=3)
    sent_early = client.now()
    clock.now = 1
    client.record("primary", Outcome.FAILURE)
    client.record("primary", Outcome.FAILURE)
    clock.now = 2
    client.record("primary", Outcome.SUCCESS, sent_at=sent_early)  # sent before they failed
    client.record("primary", Outcome.FAILURE)
    assert client.state("primary") is State.OPEN
    fresh = BreakerClient(BreakerBoard(S), sync_interval_s=60, clock=clock, trip_after=3)
    fresh.record("primary", Outcome.FAILURE)
    fresh.record("primary", Outcome.FAILURE)
    fresh.record("primary", Outcome.SUCCESS, sent_at=fresh.now())  # sent after: news
    fresh.record("primary", Outcome.FAILURE)
    assert fresh.state("primary") is State.CLOSED


async def test_a_replica_that_only_reset_a_breaker_keeps_its_copy_fresh():
    """The replica an admin's reset reaches may have served nothing yet: the other open
    breakers it took with the reset must close when the board closes them."""
    board = BreakerBoard(S)
    worker = BreakerClient(board, sync_interval_s=60)
    for _ in range(3):
        worker.record("solo", Outcome.FAILURE)
        worker.record("solo/r1", Outcome.FAILURE)
    await worker.flush()
    idle = BreakerClient(board, sync_interval_s=0.05)
    await idle.reset("solo")
    assert idle.state("solo") is State.CLOSED and idle.state("solo/r1") is State.OPEN
    await board.reset(None)
    await eventually_async(
        lambda: idle.state("solo/r1") is State.CLOSED,
        timeout_s=5,
        what="the idle replica's copy to close with the board",
    )
    await idle.aclose()
    await worker.aclose()


async def test_a_new_board_keeps_open_what_the_old_one_had_open():
    """Item 7 of issue 30: the board replaced (its application redeployed, its replica
    restarted) learns the open breakers from the gateways' next syncs, cool-down included."""
    clock = Clock()
    old = BreakerBoard(S, clock)
    client = BreakerClient(old, sync_interval_s=60, clock=clock)
    for _ in range(3):
        client.record("primary", Outcome.FAILURE)
    await client.flush()
    assert client.state("primary") is State.OPEN
    clock.now += 2  # 3 s of the 5 s cool-down left

    new = BreakerBoard(S, clock)
    client._board = new  # the handle now reaches the new board's replica
    await client.flush()
    assert client.state("primary") is State.OPEN, "the new board forgot the open breaker"
    described = (await new.describe())["primary"]
    assert described["state"] == "open" and described["adopted"] is True
    assert described["retry_in_s"] == 3.0
    clock.now += 3
    assert await client.admit("primary") is Admit.PROBE


async def test_a_new_board_adopts_only_while_young_and_never_after_a_reset():
    clock = Clock()
    held = {"primary": (int(State.OPEN), 4.0)}
    late = BreakerBoard(S, clock)
    clock.now += 11  # past ADOPT_S: the gateways' copies are the board's own word by now
    assert await late.sync([], held) == {}

    reset = BreakerBoard(S, clock)
    await reset.reset()
    assert await reset.sync([], held) == {}

    young = BreakerBoard(S, clock)
    assert await young.sync([], held) == {"primary": (int(State.OPEN), 4.0)}
