"""The fallback's active health probe: its models endpoint, checked on a timer.

Traffic tells us about the primary pool all the time; the fallback may see no traffic for
hours and then be needed at once, during an outage. So it is probed: ``/readyz`` reports the
last answer without a call of its own (a readiness probe every few seconds from every pod
should not become traffic to Gemini), and failed probes count against its breaker like failed
requests, so a fallback that died while idle is known dead before the first failover needs it.
Past an open breaker's cool-down, a check is the breaker's half-open probe: it closes it or
keeps it open, with no client's request spent on finding out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from serve_app.resilience.breaker import Admit, Outcome, State
from serve_app.resilience.client import BreakerClient

logger = logging.getLogger("ray.serve")


class HealthWatch:
    def __init__(
        self,
        name: str,
        check: Callable[[], Awaitable[bool]],
        interval_s: float,
        breakers: BreakerClient | None = None,
    ) -> None:
        self.name = name
        self._check = check
        self._interval = interval_s
        self._breakers = breakers
        self.healthy: bool | None = None  # None until the first answer
        self._task: asyncio.Task | None = None

    async def probe(self) -> bool:
        try:
            ok = bool(await self._check())
        except Exception:
            ok = False
        if ok != self.healthy:
            logger.info("backend %s health: %s", self.name, "up" if ok else "down")
        self.healthy = ok
        breakers = self._breakers
        if breakers is None:
            return ok
        if breakers.state(self.name) is not State.CLOSED and breakers.probe_ready(self.name):
            # An open breaker past its cool-down takes this check as its one probe: the
            # fallback sees no traffic while the primary is healthy, and a breaker that only a
            # failover could probe stayed open (and ForgeBreakerOpen firing) for hours.
            if await breakers.admit(self.name) is Admit.PROBE:
                breakers.record(self.name, Outcome.SUCCESS if ok else Outcome.FAILURE, probe=True)
                return ok
        if not ok:
            breakers.record(self.name, Outcome.FAILURE)
        return ok

    async def current(self) -> bool:
        """The last answer, probing now only if there is none yet."""
        if self.healthy is None:
            return await self.probe()
        return self.healthy

    def start(self) -> None:
        """Probe now and every ``interval_s`` until ``aclose``. The gateway calls this when it
        starts, not on its first ``/readyz``: an idle dead fallback must be found anyway."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(self._interval)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
