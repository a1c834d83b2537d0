"""The breaker state machine, on a hand-driven clock."""

from __future__ import annotations

import pytest

from serve_app.resilience.breaker import Admit, Breaker, BreakerSettings, Outcome, State

S = BreakerSettings(
    failure_threshold=3,
    failure_ratio=0.5,
    window_s=10,
    min_requests=10,
    cooldown_s=5,
    probe_timeout_s=30,
)


def tripped(now: float = 0.0) -> Breaker:
    b = Breaker(S, now)
    for _ in range(3):
        b.record(Outcome.FAILURE, now)
    assert b.state is State.OPEN
    return b


def test_consecutive_failures_open_it_and_a_success_resets_the_count():
    b = Breaker(S, 0)
    b.record(Outcome.FAILURE, 0)
    b.record(Outcome.FAILURE, 0)
    b.record(Outcome.SUCCESS, 0)
    b.record(Outcome.FAILURE, 0)
    b.record(Outcome.FAILURE, 0)
    assert b.state is State.CLOSED and b.admit(0) is Admit.PASS
    b.record(Outcome.FAILURE, 0)
    assert b.state is State.OPEN and b.admit(1) is Admit.DENY


def test_a_failure_ratio_over_the_window_opens_it_without_a_streak():
    b = Breaker(S, 0)
    for i in range(10):  # alternating: never 3 in a row, but half of them failed
        b.record(Outcome.FAILURE if i % 2 else Outcome.SUCCESS, i * 0.1)
    assert b.state is State.OPEN


def test_old_outcomes_leave_the_window():
    b = Breaker(S, 0)
    for i in range(9):
        b.record(Outcome.FAILURE if i % 2 else Outcome.SUCCESS, 0)
    b.record(Outcome.FAILURE, 20)  # the first nine are out of the window: 1 outcome < 10
    assert b.state is State.CLOSED


def test_neutral_outcomes_count_for_nothing():
    b = Breaker(S, 0)
    for _ in range(50):
        b.record(Outcome.NEUTRAL, 0)
    assert b.state is State.CLOSED and b.consecutive_failures == 0


def test_after_the_cooldown_exactly_one_probe_goes_through():
    b = tripped()
    assert b.admit(4.9) is Admit.DENY
    assert b.admit(5.0) is Admit.PROBE
    assert b.state is State.HALF_OPEN
    assert [b.admit(5.1) for _ in range(100)] == [Admit.DENY] * 100


@pytest.mark.parametrize(
    ("outcome", "state"), [(Outcome.SUCCESS, State.CLOSED), (Outcome.FAILURE, State.OPEN)]
)
def test_the_probe_decides(outcome, state):
    b = tripped()
    assert b.admit(6) is Admit.PROBE
    b.record(outcome, 7, probe=True)
    assert b.state is state
    if state is State.OPEN:  # a fresh cool-down from the failed probe
        assert b.admit(11.9) is Admit.DENY and b.admit(12) is Admit.PROBE


def test_a_streaming_probe_answered_with_a_4xx_resolves_it():
    """The seed system's wedge: a probe whose stream got a 4xx never reported, and the breaker
    stayed half-open with its only probe slot taken forever. A 4xx is an answer: success."""
    from serve_app.errors import ForgeError
    from serve_app.resilience.outcomes import classify

    b = tripped()
    assert b.admit(6) is Admit.PROBE
    answer = ForgeError(400, "prompt too long", type="invalid_request_error")
    b.record(classify(answer), 6.5, probe=True)
    assert b.state is State.CLOSED and b.admit(6.6) is Admit.PASS


def test_a_probe_without_a_verdict_frees_the_slot_for_the_next_request():
    b = tripped()
    assert b.admit(6) is Admit.PROBE
    b.record(Outcome.NEUTRAL, 6.2, probe=True)  # the client left before an answer
    assert b.state is State.HALF_OPEN
    assert b.admit(6.3) is Admit.PROBE


def test_a_lost_probe_is_released_after_its_timeout():
    b = tripped()
    assert b.admit(6) is Admit.PROBE  # its gateway died: no verdict ever comes
    assert b.admit(35.9) is Admit.DENY
    assert b.admit(36) is Admit.PROBE


def test_outcomes_of_requests_started_before_it_opened_are_ignored():
    b = tripped()
    b.record(Outcome.SUCCESS, 1)  # a slow request that began while it was closed
    assert b.state is State.OPEN
    assert b.admit(6) is Admit.PROBE
    b.record(Outcome.SUCCESS, 6.1)  # not the probe
    assert b.state is State.HALF_OPEN


def test_trip_opens_at_once_and_cooldown_left_counts_down():
    b = Breaker(S, 0)
    b.trip(10)
    assert b.state is State.OPEN
    assert b.cooldown_left(12) == pytest.approx(3)
    assert b.cooldown_left(20) == 0
