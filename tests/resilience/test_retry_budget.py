"""The retry budget: a share of recent requests, with a floor for quiet times."""

from __future__ import annotations

from serve_app.resilience.retry_budget import RetryBudget, RetryBudgetSettings


def test_retries_stay_within_the_ratio_of_requests_in_the_window():
    budget = RetryBudget(RetryBudgetSettings(ratio=0.1, window_s=10, min_retries=0))
    for i in range(100):
        budget.on_request(i * 0.05)
    spent = sum(budget.try_spend(5.0) for _ in range(50))
    assert spent == 10 and budget.used(5.0) == 10


def test_the_floor_lets_a_quiet_gateway_retry():
    budget = RetryBudget(RetryBudgetSettings(ratio=0.1, window_s=10, min_retries=3))
    budget.on_request(0)
    assert [budget.try_spend(0) for _ in range(4)] == [True, True, True, False]


def test_the_window_slides():
    budget = RetryBudget(RetryBudgetSettings(ratio=0.5, window_s=10, min_retries=0))
    for _ in range(4):
        budget.on_request(0)
    assert budget.try_spend(1) and budget.try_spend(1) and not budget.try_spend(1)
    assert budget.allowed(11) == 0  # the requests have left the window, and so has the credit
    for _ in range(2):
        budget.on_request(12)
    assert budget.used(12) == 0 and budget.try_spend(12) and not budget.try_spend(12)
