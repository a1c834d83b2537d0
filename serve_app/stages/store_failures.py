"""What a stage does when the store fails it: count the call and warn, then fail open.

The store is a convenience (quotas, the cache, usage), never the outage: a stage that meets a
``StoreError`` serves the request anyway. Each failure is counted in
``forge_store_errors_total{op}``; the log gets one line per interval, not one per request.
"""

from __future__ import annotations

import logging
import time

from serve_app.metrics import ForgeMetrics
from serve_app.store import StoreError

logger = logging.getLogger("ray.serve")

WARN_EVERY_S = 30.0


class StoreFailures:
    def __init__(self, metrics: ForgeMetrics, consequence: str) -> None:
        self.metrics = metrics
        self.consequence = consequence  # what it means for requests: "retried until it lands"
        self._last_warning = -WARN_EVERY_S

    def __call__(self, op: str, exc: StoreError) -> None:
        self.metrics.store_errors.inc(tags={"op": op})
        self.metrics.store_errors_seen[op] += 1
        now = time.monotonic()
        if now - self._last_warning >= WARN_EVERY_S:
            self._last_warning = now
            logger.warning("store unavailable (%s: %s); %s", op, exc, self.consequence)
