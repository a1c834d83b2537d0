"""What a backend's answer means for its breaker and for a retry.

One function, so dispatch, the probe and the tests agree: the backend answered (any 4xx
included: it is up, the request was wrong) → success; 5xx, transport errors and timeouts →
failure; busy (at capacity, rate limiting us) or no answer at all (the client left) → neutral.
Only 5xx may be retried, and only before the first byte.
"""

from __future__ import annotations

from serve_app.errors import ForgeError
from serve_app.resilience.breaker import Outcome

# Codes of 5xx that say "busy", not "broken": fail over, but do not open a breaker over load.
_BUSY_CODES = frozenset({"backend_at_capacity"})
# 5xx that no other backend could do better: the client's own deadline has run out.
_FINAL_CODES = frozenset({"client_deadline_exceeded"})


def classify(error: ForgeError | None) -> Outcome:
    if error is None or error.status < 500:
        return Outcome.SUCCESS
    if error.code in _BUSY_CODES or error.code in _FINAL_CODES:
        return Outcome.NEUTRAL
    return Outcome.FAILURE


def retryable(error: ForgeError) -> bool:
    """Worth another backend: the backend failed or was busy; a 4xx would fail anywhere."""
    return error.status >= 500 and error.code not in _FINAL_CODES
