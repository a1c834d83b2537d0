"""What a backend's answer means for its breaker and for a retry (no Ray needed)."""

from __future__ import annotations

import pytest
from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError

from serve_app import errors
from serve_app.backends.fallback import _upstream_error
from serve_app.backends.pool import as_forge_error
from serve_app.engines.base import EngineError
from serve_app.resilience.breaker import Outcome
from serve_app.resilience.outcomes import classify, retryable


@pytest.mark.parametrize(
    ("raised", "status", "outcome"),
    [
        (TimeoutError(), 504, Outcome.FAILURE),  # a deadline passed: the backend failed
        (ActorDiedError(), 502, Outcome.FAILURE),  # the replica process is gone
        (EngineError("boom"), 502, Outcome.FAILURE),
        (BackPressureError(num_queued_requests=9, max_queued_requests=8), 503, Outcome.NEUTRAL),
        (errors.invalid_request("prompt too long"), 400, Outcome.SUCCESS),  # it answered
    ],
)
def test_pool_errors_become_statuses_and_breaker_outcomes(raised, status, outcome):
    err = as_forge_error(raised)
    assert err.status == status and classify(err) is outcome
    assert retryable(err) is (status >= 500)


@pytest.mark.parametrize(
    ("upstream", "status", "outcome"),
    [
        (500, 502, Outcome.FAILURE),
        (401, 502, Outcome.FAILURE),  # our credentials: Forge's problem, not the client's
        (429, 503, Outcome.NEUTRAL),  # the provider rate limits us: busy, not broken
        (400, 400, Outcome.SUCCESS),  # the client's request: passed on, never retried
    ],
)
def test_fallback_answers_become_statuses_and_breaker_outcomes(upstream, status, outcome):
    err = _upstream_error(upstream, b'{"error": {"message": "nope"}}')
    assert err.status == status and classify(err) is outcome


def test_a_timeout_is_a_failure_and_no_error_a_success():
    assert classify(errors.upstream_timeout("x")) is Outcome.FAILURE
    assert classify(None) is Outcome.SUCCESS
