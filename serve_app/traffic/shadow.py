"""Shadow traffic: a copy of a request sent to a candidate pool, its answer discarded.

The copy starts beside the real request and never waits for it nor makes it wait: it runs in a
task of its own, bounded per gateway replica (``max_inflight``; past it a copy is dropped and
counted, never queued), with no quota, slot, retry or breaker of the tenant's. What it costs is
counted apart (``forge_shadow_tokens_total``), never in the tenant's usage, and its time to first
byte and errors are recorded (``forge_shadow_*``), so a candidate is measured on real prompts
before it takes any.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import Mapping

from serve_app import errors
from serve_app.backends.base import Backend
from serve_app.metrics import ForgeMetrics

logger = logging.getLogger("ray.serve")

DEFAULT_MAX_INFLIGHT = 64


class Shadows:
    def __init__(
        self,
        backends: Mapping[str, Backend],
        metrics: ForgeMetrics,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
    ) -> None:
        self.backends = backends
        self.metrics = metrics
        self.max_inflight = max_inflight
        self._running: set[asyncio.Task] = set()
        self.counts: Counter[str] = Counter()  # "model/pool/status" → copies (for /admin/status)

    def mirror(self, model: str, pool: str, body: dict, kind: str) -> None:
        """Start a copy of ``body`` on ``pool`` (a generation pool), or count it dropped."""
        tags = {"model": model, "pool": pool}
        if len(self._running) >= self.max_inflight:
            self._count(tags, "dropped")
            return
        task = asyncio.get_running_loop().create_task(self._run(tags, pool, body, kind))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, tags: dict[str, str], pool: str, body: dict, kind: str) -> None:
        backend = self.backends[pool]
        key = uuid.uuid4().hex
        started = time.perf_counter()
        status, usage = "ok", None
        try:
            stream = backend.stream({**body, "stream": True}, kind, key)
            try:
                first = True
                async for batch in stream:
                    for item in batch:
                        errors.raise_if_refused(item)
                        if type(item) is bytes:
                            if first:
                                first = False
                                ttft = time.perf_counter() - started
                                self.metrics.shadow_ttft.observe(ttft, tags=tags)
                        elif "usage" in item:
                            usage = item["usage"]
            finally:
                await stream.aclose()
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        except Exception as exc:  # the candidate's failure is a number here, nobody's error
            status = "error"
            logger.debug("shadow copy to %s failed: %r", tags["pool"], exc)
        finally:
            if backend.pool is not None:
                backend.pool.take_routed(key)
            self._count(tags, status)
            for kind_name in ("prompt_tokens", "completion_tokens"):
                count = (usage or {}).get(kind_name) or 0
                if count:
                    self.metrics.shadow_tokens.inc(
                        count, tags={**tags, "kind": kind_name.removesuffix("_tokens")}
                    )

    def _count(self, tags: dict[str, str], status: str) -> None:
        self.metrics.shadow_requests.inc(tags={**tags, "status": status})
        self.counts[f"{tags['model']}/{tags['pool']}/{status}"] += 1

    async def aclose(self) -> None:
        for task in list(self._running):
            task.cancel()
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
