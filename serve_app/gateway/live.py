"""Live configuration on a running gateway replica: validate a change, apply it or refuse it,
and keep the pool schedulers and the breaker board on the settings this replica serves.

Serve hands the gateway deployment's ``user_config`` to ``Gateway.reconfigure`` when a replica
starts and whenever it changes. What may change, and how it merges over the application's args,
is ``serve_app/config/live.py``; how the gateway swaps its own pipeline is ``Gateway.apply``.
This module decides what happens around that. A change to a running replica that does not
apply is refused, logged, counted (``forge_config_changes_total``) and shown in ``GET
/admin/status`` and ``/readyz``, and the replica keeps serving what it had (raising then would
make Serve stop the replica and start one that fails the same way). A replica that starts while
the target is bad (a scale-up, a replacement) starts from what a running replica serves (its
``peers``), and says so the same way; with no running replica to ask (a first deploy), the
invalid configuration fails the replica with each bad field's path (Serve shows it in ``serve
status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
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
KEY_FILES_CHECK_S = 2.0  # a key removed from a mounted key file stops working within this
PEER_WAIT_S = 5.0  # how long a starting replica waits for a running one's configuration

# What a running replica of the deployment serves (its user_config), or None: no replica runs,
# or none has applied one.
Peers = Callable[[], Awaitable[dict | None]]


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
        peers: Peers | None = None,
    ) -> None:
        self._base, self._apply, self._metrics = base, apply, metrics
        self._schedulers, self._breakers = schedulers, breakers
        self.peers = peers
        self.config = base  # what this replica serves now
        self.user_config: dict | None = None  # the live change it serves, for a starting peer
        self._reconfigured = False
        self.status = {"digest": live_digest(base), "applied_at": time.time(), "refused": None}
        self._changed = asyncio.Event()
        self._push_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._key_files_seen = _key_files_state(base)

    async def reconfigure(self, user_config: dict) -> None:
        before = self.status["digest"]
        try:
            # Everything is built before anything is swapped: a failure changes nothing.
            config = apply_live(self._base, user_config)
            self._apply(config)
        except Exception as err:  # a bad field (ConfigError), a key file unreadable or malformed
            if not self._reconfigured:
                if await self._start_as_peers_serve(user_config, err):
                    return
                raise
            digest = settings_digest(user_config)
            if (self.status["refused"] or {}).get("digest") == digest:
                return  # Serve sent the refused target again (it does after a start): said once
            logger.error("live configuration %s refused, still serving %s: %s", digest, before, err)
            self._metrics.config_changes.inc(tags={"outcome": "refused"})
            self.status = {**self.status, "refused": {"digest": digest, "error": str(err)}}
            return
        self._serve(config, user_config, refused=None)
        self._metrics.config_changes.inc(tags={"outcome": "applied"})
        logger.info("live configuration %s applied (was %s)", self.status["digest"], before)

    def _serve(self, config: ForgeConfig, user_config: dict, refused: dict | None) -> None:
        """``config`` (``user_config`` over the base) is what this replica serves from now on;
        the schedulers and the board hear of it."""
        self._reconfigured = True
        self.config, self.user_config = config, user_config
        self.status = {"digest": live_digest(config), "applied_at": time.time(), "refused": refused}
        self._changed.set()

    async def _start_as_peers_serve(self, target: dict, err: Exception) -> bool:
        """Serve what a running replica serves, with the target refused: whether that worked.
        Starting would otherwise fail, and fail again on every retry, while the target stays."""
        if self.peers is None:
            return False
        try:
            served = await asyncio.wait_for(self.peers(), PEER_WAIT_S)
            if served is None:
                return False
            config = apply_live(self._base, served)
            self._apply(config)
        except Exception as peer_err:  # none answers in time, or what it serves does not apply
            logger.error("no running replica's configuration to start from: %r", peer_err)
            return False
        target_digest = settings_digest(target)
        refused = {"digest": target_digest, "error": str(err), "started_from": "a running replica"}
        self._serve(config, served, refused)
        self._metrics.config_changes.inc(tags={"outcome": "refused"})
        logger.error(
            "live configuration %s refused at start-up; serving %s, a running replica's: %s",
            target_digest,
            self.status["digest"],
            err,
        )
        return True

    def start(self) -> None:
        """Push this replica's settings to the schedulers and the board from now on, and watch
        the mounted key files."""
        loop = asyncio.get_running_loop()
        if self._push_task is None:
            self._push_task = loop.create_task(self._push_settings())
        if self._watch_task is None and self._key_files_seen:
            self._watch_task = loop.create_task(self._watch_key_files())

    def stop(self) -> None:
        for task in (self._push_task, self._watch_task):
            if task is not None:
                task.cancel()

    async def _watch_key_files(self) -> None:
        """A mounted key file (tenants' or operators') that changes is read again: a revoked
        key stops working within ``KEY_FILES_CHECK_S``, with no live change to wait for. A
        file that does not read (half-written, malformed) is refused like a bad live change:
        the keys it had keep working, and the refusal shows in ``/admin/status``."""
        while True:
            await asyncio.sleep(KEY_FILES_CHECK_S)
            seen = _key_files_state(self.config)
            if seen == self._key_files_seen:
                continue
            self._key_files_seen = seen
            try:
                self._apply(self.config)  # KeyRing.from_config reads the files again
            except Exception as err:
                logger.error("key files changed and do not read, keys unchanged: %s", err)
                self._metrics.config_changes.inc(tags={"outcome": "refused"})
                self.status = {**self.status, "refused": {"digest": "key files", "error": str(err)}}
                continue
            self._metrics.config_changes.inc(tags={"outcome": "applied"})
            self.status = {**self.status, "keys_read_at": time.time(), "refused": None}
            logger.info("key files changed: keys read again")

    @property
    def refused(self) -> bool:
        """Whether this replica is serving an older configuration than its target."""
        return self.status.get("refused") is not None

    def scheduler_settings(self, pool: str) -> tuple[dict, list[dict]]:
        """A pool's admission settings and the tenants, as this replica serves them now."""
        config = self.config
        admission = next(p.admission for p in config.pools if p.name == pool)
        return admission.model_dump(), [t.model_dump() for t in config.tenants]

    async def _push_settings(self) -> None:
        """At once, after a change, then every ``SETTINGS_RESEND_S`` (a restarted scheduler
        or board comes back with the args' settings, or none in the control application, and
        catches up here; a repeat is a no-op)."""
        self._changed.set()  # the first round at once: a control application's start waits
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


def _key_files_state(config: ForgeConfig) -> dict[str, tuple[float, int] | None]:
    """Each mounted key file's (mtime, size), None where it is missing: what tells a change
    (a Kubernetes secret update swaps the file's symlink, which changes both)."""
    paths = [p for p in (config.key_hashes_file, config.admin.key_hashes_file) if p]
    state: dict[str, tuple[float, int] | None] = {}
    for path in paths:
        try:
            stat = os.stat(path)
        except OSError:
            state[path] = None
        else:
            state[path] = (stat.st_mtime, stat.st_size)
    return state
