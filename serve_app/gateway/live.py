"""Live configuration on a running gateway replica: validate a change, apply it or refuse it,
and keep the pool schedulers and the breaker board on the settings this replica serves.

Serve hands the gateway deployment's ``user_config`` to ``Gateway.reconfigure`` when a replica
starts and whenever it changes. What may change, and how it merges over the application's args,
is ``serve_app/config/live.py``; how the gateway swaps its own pipeline is ``Gateway.apply``.
This module decides what happens around that: at start an invalid configuration fails the
replica with each bad field's path (Serve shows it in ``serve status``); later it is refused,
logged, counted (``forge_config_changes_total``) and shown in ``GET /admin/status``, and the
replica keeps serving what it had (raising then would make Serve stop the replica and start one
that fails the same way).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict

from serve_app.admission.client import SchedulerClient
from serve_app.config.digest import settings_digest
from serve_app.config.live import apply_live, live_digest
from serve_app.config.models import ForgeConfig
from serve_app.metrics import ForgeMetrics
from serve_app.resilience.client import BreakerClient
from serve_app.resilience.settings import breaker_settings

logger = logging.getLogger("ray.serve")

SETTINGS_RESEND_S = 10.0  # a restarted scheduler or board catches up within this


class LiveUpdates:
    """One gateway replica's live configuration: ``base`` is the args' configuration, which
    each change's sections go over; ``apply`` swaps a valid one in (``Gateway.apply``)."""

    def __init__(
        self,
        base: ForgeConfig,
        apply: Callable[[ForgeConfig], None],
        metrics: ForgeMetrics,
        schedulers: Mapping[str, SchedulerClient],
        breakers: BreakerClient,
    ) -> None:
        self._base, self._apply, self._metrics = base, apply, metrics
        self._schedulers, self._breakers = schedulers, breakers
        self.config = base  # what this replica serves now
        self._reconfigured = False
        self.status = {"digest": live_digest(base), "applied_at": time.time(), "refused": None}
        self._changed = asyncio.Event()
        self._push_task: asyncio.Task | None = None

    async def reconfigure(self, user_config: dict) -> None:
        before = self.status["digest"]
        try:
            # Everything is built before anything is swapped: a failure changes nothing.
            config = apply_live(self._base, user_config)
            self._apply(config)
        except (ValueError, OSError) as err:  # a bad field (ConfigError), a bad key file
            if not self._reconfigured:
                raise
            digest = settings_digest(user_config)
            logger.error("live configuration %s refused, still serving %s: %s", digest, before, err)
            self._metrics.config_changes.inc(tags={"outcome": "refused"})
            self.status = {**self.status, "refused": {"digest": digest, "error": str(err)}}
            return
        self._reconfigured = True
        self.config = config
        self.status = {"digest": live_digest(config), "applied_at": time.time(), "refused": None}
        self._changed.set()
        self._metrics.config_changes.inc(tags={"outcome": "applied"})
        logger.info("live configuration %s applied (was %s)", self.status["digest"], before)

    def start(self) -> None:
        """Push this replica's settings to the schedulers and the board from now on."""
        if self._push_task is None:
            self._push_task = asyncio.get_running_loop().create_task(self._push_settings())

    def stop(self) -> None:
        if self._push_task is not None:
            self._push_task.cancel()

    async def _push_settings(self) -> None:
        """At once after a change, then every ``SETTINGS_RESEND_S`` (a restarted scheduler or
        board comes back with the args' settings and catches up here; a repeat is a no-op)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), SETTINGS_RESEND_S)
            self._changed.clear()
            config = self.config
            tenants = [t.model_dump() for t in config.tenants]
            for pool in config.pools:
                scheduler = self._schedulers.get(pool.name)
                if scheduler is None or pool.admission is None:
                    continue
                try:
                    await scheduler.configure(pool.admission.model_dump(), tenants)
                except Exception as exc:  # down or restarting: the next round tries again
                    logger.warning("scheduler %s: settings not delivered: %r", pool.name, exc)
            try:
                await self._breakers.configure_board(
                    asdict(breaker_settings(config.resilience.breaker))
                )
            except Exception as exc:
                logger.warning("breaker board: settings not delivered: %r", exc)
