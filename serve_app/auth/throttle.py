"""The failed-auth throttle: repeated bad keys from one address, or under one key prefix, are
answered 429 with ``Retry-After`` instead of 401, in memory, never touching the store.

Auth runs before quota so that anonymous traffic stays cheap: a flood of bad keys must cost no
store command, and this throttle keeps it so (its state is a bounded dict in the gateway
replica). A key is checked before the throttle is: a valid key always passes, so a tenant who
shares an address with an attacker (every client does behind a proxy that adds no
``X-Forwarded-For``, as Serve's HAProxy) is never locked out; only the attacker's failures turn
from 401 into 429. The limit is per gateway replica (N replicas: N times the allowance).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from serve_app import errors
from serve_app.auth.keys import KeyRing
from serve_app.config.models import AuthThrottleConfig, TenantConfig

# Characters of the presented key that name its family: enough to tell "sk-forge-Ab" from
# "sk-forge-Xy" without keeping anything that could be brute-forced back into a key.
PREFIX_CHARS = 11


class FailedAuthThrottle:
    def __init__(
        self,
        config: AuthThrottleConfig,
        on_throttle: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.on_throttle = on_throttle  # counts a 429 (forge_shed_total{reason="auth_throttle"})
        self.clock = clock
        # ("address" | "prefix", value) → times of its recent failures, least recently failed
        # first; at most max_tracked subjects, each at most its limit + 1 entries.
        self._failures: OrderedDict[tuple[str, str], deque[float]] = OrderedDict()

    def refusal(self, address: str | None, token: str) -> errors.ForgeError:
        """Record one failed attempt; the answer to give it: a 401, or a 429 with
        ``Retry-After`` once its address or key prefix has failed too often lately."""
        now = self.clock()
        config = self.config
        waits = [
            self._record(("address", address or "unknown"), config.max_failures_per_address, now),
            self._record(("prefix", token[:PREFIX_CHARS]), config.max_failures_per_prefix, now),
        ]
        wait = max(waits)
        if wait <= 0:
            return errors.invalid_api_key("Incorrect API key provided.")
        self.on_throttle()
        return errors.ForgeError(
            429,
            "Too many requests with invalid API keys from this client; retry later.",
            type="rate_limit_error",
            code="too_many_failed_auth",
            headers={"retry-after": str(max(1, math.ceil(wait)))},
        )

    def _record(self, subject: tuple[str, str], limit: int, now: float) -> float:
        """Add a failure; how long until the subject is under its limit again (0: it is)."""
        window = self.config.window_s
        times = self._failures.pop(subject, None)
        if times is None:
            times = deque(maxlen=limit + 1)
        while times and times[0] <= now - window:
            times.popleft()
        times.append(now)
        self._failures[subject] = times  # most recently failed last
        while len(self._failures) > self.config.max_tracked:
            self._failures.popitem(last=False)
        if len(times) <= limit:
            return 0.0
        return times[0] + window - now

    def tracked(self) -> int:
        return len(self._failures)


def authenticate(
    keyring: KeyRing,
    authorization: str | None,
    address: str | None,
    throttle: FailedAuthThrottle | None,
) -> TenantConfig:
    """The caller's tenant; a 401 for a missing or malformed header (never throttled: it costs
    no hash), and for a wrong key a 401 or, once throttled, a 429."""
    try:
        return keyring.tenant_for(authorization)
    except errors.ForgeError:
        if throttle is None or not authorization:
            raise
        raise throttle.refusal(address, authorization.partition(" ")[2].strip()) from None
