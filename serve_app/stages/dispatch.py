"""The last stage: choose a backend past the breakers, relay its answer, retry before byte one.

Order of backends per model: the primary pool, then the fallback. A backend whose breaker is
open, or a pool at zero replicas (which is woken meanwhile), is routed around without a try:
that is a free routing decision, not a retry. A backend that fails before anything has reached
the client may be retried once, on the next backend (or, with no fallback, another replica of
the pool), while the retry budget allows. A stream is committed (headers sent) once its first
batch has arrived; after that a failure ends it honestly with an SSE error event, and text the
client has seen is never repeated or spliced.

Every attempt's outcome goes to its breakers (the pool's and the replica's, or the fallback's):
at its end, or at its first batch when it was a half-open probe, so a long stream never holds
the only probe slot for its whole generation.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import orjson
from starlette.responses import Response

from serve_app import errors, sse
from serve_app.backends.base import Backend
from serve_app.backends.pool import PoolBackend
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import EventStream, RequestContext
from serve_app.resilience.breaker import Admit, Outcome, State
from serve_app.resilience.client import BreakerClient
from serve_app.resilience.outcomes import classify, retryable
from serve_app.resilience.retry_budget import RetryBudget
from serve_app.routing.ledger import replica_backend

logger = logging.getLogger("ray.serve")

_STREAM_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_MAX_ATTEMPTS = 2  # the first try and at most one retry


@dataclass(slots=True)
class _Attempt:
    """One try on one backend, and what its breakers must hear about it."""

    backend: Backend
    probe: bool  # the backend's half-open probe
    replica: str | None = None  # the pool replica it went to
    replica_probe: bool = False
    resolved: bool = False  # probes resolved early (at the first batch)


class Dispatch:
    def __init__(
        self,
        routes: dict[str, Sequence[Backend]],
        breakers: BreakerClient | None = None,
        retry_budget: RetryBudget | None = None,
        metrics: ForgeMetrics | None = None,
    ) -> None:
        # model name → backends in order of preference (primary pool, then fallback)
        self.routes = routes
        self.breakers = breakers
        self.budget = retry_budget
        self.metrics = metrics

    async def __call__(self, ctx: RequestContext) -> Response:
        candidates = self.routes.get(ctx.parsed.model)
        if not candidates:
            raise errors.model_not_found(ctx.parsed.model)
        if self.budget is not None:
            self.budget.on_request(time.monotonic())
        budget_s = ctx.client_timeout_s
        failure: errors.ForgeError | None = None
        attempts = 0
        for backend in _with_retry(candidates):
            if attempts == _MAX_ATTEMPTS:
                break
            if attempts and not _another_chance(backend, ctx):
                continue
            admit = await self._admit(backend)
            if admit is Admit.DENY:
                continue
            if attempts and not self._spend_retry(backend, failure):
                if admit is Admit.PROBE and self.breakers is not None:
                    # Granted but never sent: free the probe slot for the next request.
                    self.breakers.record(backend.name, Outcome.NEUTRAL, probe=True)
                break
            attempts += 1
            attempt = _Attempt(backend, probe=admit is Admit.PROBE)
            failed_replica, ctx.replica = ctx.replica, None
            if failed_replica and isinstance(backend, PoolBackend):
                backend.ledger.avoid[ctx.request_id] = failed_replica
            remaining = None if budget_s is None else budget_s - (time.perf_counter() - ctx.started)
            try:
                if ctx.parsed.stream:
                    return await self._stream(ctx, attempt, candidates, remaining)
                return await self._complete(ctx, attempt, candidates, remaining)
            except errors.ForgeError as err:
                self._settle(attempt, ctx, classify(err))
                if not retryable(err):
                    raise
                failure = err
            except asyncio.CancelledError:  # the client left before the first byte
                self._settle(attempt, ctx, Outcome.NEUTRAL)
                raise
        raise failure or self._none_available(candidates)

    # -- choosing ----------------------------------------------------------------------------

    async def _admit(self, backend: Backend) -> Admit:
        if isinstance(backend, PoolBackend) and backend.replica_count() == 0:
            # Scaled to zero: serve elsewhere now, wake it, and let it back in through its probe.
            if self.breakers is not None and self.breakers.state(backend.name) is State.CLOSED:
                self.breakers.trip(backend.name)
            backend.wake()
            self._skipped(backend, "cold")
            return Admit.DENY
        if self.breakers is None:
            return Admit.PASS
        admit = await self.breakers.admit(backend.name)
        if admit is Admit.DENY:
            self._skipped(backend, "breaker_open")
        return admit

    def _spend_retry(self, backend: Backend, failure: errors.ForgeError | None) -> bool:
        if failure is None:
            return True  # nothing was tried yet: the earlier backends were routed around
        if self.budget is None:
            return True
        now = time.monotonic()
        spent = self.budget.try_spend(now)
        if self.metrics is not None:
            if spent:
                self.metrics.retries.inc(tags={"backend": backend.name})
            else:
                self.metrics.retries_denied.inc()
            self.metrics.retry_budget.set(self.budget.allowed(now) - self.budget.used(now))
        return spent

    def _none_available(self, candidates: Sequence[Backend]) -> errors.ForgeError:
        wait = 1.0
        if self.breakers is not None:
            wait = min(self.breakers.retry_after(b.name) for b in candidates) or 1.0
        err = errors.backend_unavailable(
            "No backend for this model can take requests right now; retry shortly."
        )
        err.headers["retry-after"] = str(max(1, math.ceil(wait)))
        return err

    def _skipped(self, backend: Backend, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.backend_skipped.inc(tags={"backend": backend.name, "reason": reason})

    # -- outcomes ----------------------------------------------------------------------------

    def _settle(self, attempt: _Attempt, ctx: RequestContext, outcome: Outcome) -> None:
        """Tell the attempt's breakers how it went (once; probes may have been told already)."""
        self._collect_replica(attempt, ctx)
        if self.breakers is None or attempt.resolved:
            return
        attempt.resolved = True
        self.breakers.record(attempt.backend.name, outcome, probe=attempt.probe)
        if attempt.replica is not None:
            self.breakers.record(
                replica_backend(attempt.backend.name, attempt.replica),
                outcome,
                probe=attempt.replica_probe,
            )

    def _resolve_probes(self, attempt: _Attempt, ctx: RequestContext) -> None:
        """The first batch arrived: a probing backend is answering. Say so now, not at the end."""
        self._collect_replica(attempt, ctx)
        if self.breakers is None or not (attempt.probe or attempt.replica_probe):
            return
        self._settle(attempt, ctx, Outcome.SUCCESS)

    @staticmethod
    def _collect_replica(attempt: _Attempt, ctx: RequestContext) -> None:
        if attempt.replica is None and isinstance(attempt.backend, PoolBackend):
            routed = attempt.backend.ledger.take_routed(ctx.request_id)
            if routed is not None:
                attempt.replica, attempt.replica_probe = routed
                ctx.replica = attempt.replica

    # -- serving -----------------------------------------------------------------------------

    async def _complete(
        self,
        ctx: RequestContext,
        attempt: _Attempt,
        candidates: Sequence[Backend],
        budget_s: float | None,
    ) -> Response:
        backend = attempt.backend
        result = await backend.complete(ctx.body, ctx.route, ctx.request_id, budget_s)
        self._settle(attempt, ctx, Outcome.SUCCESS)
        _release_pool_slot_on_failover(ctx, backend, candidates)
        response = result["response"]
        ctx.backend, ctx.usage = backend.name, response.get("usage")
        ctx.replica = result["replica"] or ctx.replica
        ctx.first_byte_at = time.perf_counter()
        return Response(
            orjson.dumps(response), media_type="application/json", headers=_served_by(ctx)
        )

    async def _stream(
        self,
        ctx: RequestContext,
        attempt: _Attempt,
        candidates: Sequence[Backend],
        budget_s: float | None,
    ) -> Response:
        backend = attempt.backend
        stream = backend.stream(ctx.body, ctx.route, ctx.request_id, budget_s)
        try:
            first = await anext(stream, [])
        except BaseException:
            await stream.aclose()
            raise
        ctx.backend = backend.name
        self._resolve_probes(attempt, ctx)
        _release_pool_slot_on_failover(ctx, backend, candidates)
        head = _take(ctx, first)
        return EventStream(
            self._relay(ctx, attempt, head, stream),
            close_source=stream.aclose,
            headers={**_STREAM_HEADERS, **_served_by(ctx)},
        )

    async def _relay(
        self, ctx: RequestContext, attempt: _Attempt, head: bytes, stream: AsyncIterator[list]
    ):
        outcome = Outcome.NEUTRAL  # unless it ends one way or the other: the client left
        try:
            if head:
                ctx.first_byte_at = time.perf_counter()
                yield head
            async for batch in stream:
                out = _take(ctx, batch)
                if out:
                    if ctx.first_byte_at is None:
                        ctx.first_byte_at = time.perf_counter()
                    yield out
            outcome = Outcome.SUCCESS
            yield sse.DONE
        except errors.ForgeError as err:
            outcome = classify(err)
            ctx.stream_error = err.message
            yield errors.error_event(err)
        except Exception:
            # Headers are sent: the only honest end left is an error event, never a truncation.
            logger.exception("stream %s failed after its first byte", ctx.request_id)
            outcome = Outcome.FAILURE
            err = errors.bad_gateway("The stream failed after it started.")
            ctx.stream_error = err.message
            yield errors.error_event(err)
        finally:
            self._settle(attempt, ctx, outcome)
            await stream.aclose()


def _with_retry(candidates: Sequence[Backend]) -> list[Backend]:
    """Where a retry may go: the next backend; with just one, that backend again (for a pool,
    another replica: the router avoids the one that failed)."""
    return list(candidates) if len(candidates) > 1 else [candidates[0], candidates[0]]


def _another_chance(backend: Backend, ctx: RequestContext) -> bool:
    """A retry on the pool that just failed needs another replica to go to: one that failed
    (``ctx.replica``) and another one up. A request no replica took (the pool at capacity, or
    none took it in time) would meet the same pool again."""
    if isinstance(backend, PoolBackend):
        return ctx.replica is not None and (backend.replica_count() or 0) > 1
    return True


def _release_pool_slot_on_failover(
    ctx: RequestContext, backend: Backend, candidates: Sequence[Backend]
) -> None:
    """The pool's admission slot guards the pool's GPUs: a request the fallback serves gives
    it back now instead of holding it for the whole external generation."""
    if backend is not candidates[0] and ctx.release_slot is not None:
        ctx.release_slot()


def _served_by(ctx: RequestContext) -> dict[str, str]:
    headers = {"x-forge-backend": ctx.backend}
    if ctx.replica:
        headers["x-forge-replica"] = ctx.replica
    return headers


def _take(ctx: RequestContext, batch: list) -> bytes:
    """The frames of a batch as one write; metadata items are kept on the context."""
    frames = []
    for item in batch:
        if type(item) is bytes:
            frames.append(item)
            ctx.frames_sent += 1
        elif "usage" in item:
            ctx.usage = item["usage"]
        elif "replica" in item:
            ctx.replica = item["replica"]
    return b"".join(frames)
