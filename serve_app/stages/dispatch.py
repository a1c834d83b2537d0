"""The endpoint of the pipeline: a backend past the breakers, its answer relayed, a retry
before byte one.

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
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import get_args

import orjson
from opentelemetry import trace
from starlette.responses import Response

from serve_app import errors
from serve_app.backends.base import Backend, PoolControl
from serve_app.bridge import replica_backend
from serve_app.engines.base import Kind
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import EventStream, RequestContext
from serve_app.resilience.breaker import Admit, Outcome, State
from serve_app.resilience.client import BreakerClient
from serve_app.resilience.outcomes import classify, retryable
from serve_app.resilience.retry_budget import RetryBudget
from serve_app.stages.relay import STREAM_HEADERS, ClosedOnce, relay, take_frames
from serve_app.traffic.policy import ALL_CONDITIONS as _ALL
from serve_app.traffic.shadow import Shadows

_MAX_ATTEMPTS = 2  # the first try and at most one retry


@dataclass(slots=True)
class Attempt:
    """One try on one backend, and what its breakers must hear about it (exactly once)."""

    backend: Backend
    breakers: BreakerClient | None
    probe: bool  # the backend's half-open probe
    replica: str | None = None  # the pool replica it went to
    offered: tuple[str, ...] = ()  # or, not yet known, the ones it may have started on
    replica_probe: bool = False
    resolved: bool = False  # the breakers were told (probes: at the first batch)
    sent_at: float | None = None  # on the breakers' clock: old successes end no failure streak

    def collect_replica(self, ctx: RequestContext) -> None:
        """Which replica the pool's router chose; known once the call was routed."""
        pool = self.backend.pool
        if self.replica is None and pool is not None:
            routed = pool.take_routed(ctx.key)
            if routed is not None:
                self.replica, self.replica_probe = routed
                ctx.replica = self.replica
            else:  # Serve had not said yet (``PoolBridge.offered``); routed, it was dropped
                self.offered = pool.take_offered(ctx.key) or self.offered

    def settle(self, ctx: RequestContext, outcome: Outcome) -> None:
        """Tell the backend's breaker, and its replica's, how the attempt went."""
        self.collect_replica(ctx)
        if self.breakers is None or self.resolved:
            return
        self.resolved = True
        self.breakers.record(self.backend.name, outcome, probe=self.probe, sent_at=self.sent_at)
        if self.replica is not None:
            self.breakers.record(
                replica_backend(self.backend.name, self.replica),
                outcome,
                probe=self.replica_probe,
                sent_at=self.sent_at,
            )

    def answering(self, ctx: RequestContext) -> None:
        """The first batch arrived: a probing backend is answering. Say so now, not at the end
        of a long stream that would hold the only probe slot."""
        self.collect_replica(ctx)
        if self.probe or self.replica_probe:
            self.settle(ctx, Outcome.SUCCESS)


class Dispatch:
    def __init__(
        self,
        routes: dict[str, Sequence[Backend]],
        breakers: BreakerClient | None = None,
        retry_budget: RetryBudget | None = None,
        metrics: ForgeMetrics | None = None,
        conditions: Mapping[str, Sequence[frozenset[str]]] | None = None,
        served: Mapping[str, str] | None = None,
        shadows: Shadows | None = None,
    ) -> None:
        """``routes``: route → backends in order of preference (a pool, then the fallback; a
        model's chain, ``traffic/policy.py``); ``conditions``: route → what takes each backend
        after the one before it (absent: anything does); ``served``: pool name → its model,
        what usage is recorded under when a pool answers a name that is not its model's."""
        self.routes = routes
        conditions = conditions or {}
        # (route, kind) → those of them that serve the kind (an upstream without
        # /v1/completions), with their conditions, once here rather than on every request.
        self._serving = {
            (route, kind): [
                (b, on)
                for b, on in zip(backends, conditions.get(route) or _all(backends), strict=True)
                if kind in b.kinds
            ]
            for route, backends in routes.items()
            for kind in get_args(Kind)
        }
        self.served = dict(served or {})
        self.shadows = shadows
        self.breakers = breakers
        self.budget = retry_budget
        self.metrics = metrics

    async def __call__(self, ctx: RequestContext) -> Response:
        target = ctx.target
        route = target.route if target is not None else ctx.parsed.model
        if not self.routes.get(route):
            raise errors.model_not_found(ctx.parsed.model)
        steps = self._serving.get((route, ctx.route))
        if steps and target is not None and target.start:
            first = target.steps[target.start].backend  # where admission spilled it
            steps = steps[next((i for i, (b, _) in enumerate(steps) if b.name == first), 0) :]
        if not steps:  # the fallback's own model, on a route its upstream lacks
            raise errors.unsupported_route(ctx.parsed.model, ctx.route)
        candidates = [b for b, _ in steps]
        if target is not None and target.shadow is not None and self.shadows is not None:
            self.shadows.mirror(target.model, target.shadow.pool, ctx.body, ctx.route)
        if self.budget is not None:
            self.budget.on_request(time.monotonic())
        plan = _Plan(self, ctx, steps)
        failure: errors.ForgeError | None = None
        probed = False  # the failed attempt was a half-open probe
        while (attempt := await plan.next(failure, probed)) is not None:
            try:
                return await self._serve(ctx, attempt, candidates)
            except errors.ForgeError as failed:
                err = ctx.own_timeout(failed)
                attempt.settle(ctx, classify(err))
                _event("forge.attempt_failed", backend=attempt.backend.name, status=err.status)
                if ctx.first_failure is None:
                    ctx.first_failure = attempt.backend.name
                if err is not failed:  # the client's own deadline: final, nobody's fault,
                    # and the engine's work is charged, as a client's that left is
                    await _charge_abandoned(ctx, attempt.backend, attempt.offered)
                    raise err from None
                if not retryable(err):
                    raise
                failure, probed = err, attempt.probe or attempt.replica_probe
            except asyncio.CancelledError:  # the client left before the first byte
                attempt.settle(ctx, Outcome.NEUTRAL)  # and learns the replica it went to
                await _charge_abandoned(ctx, attempt.backend, attempt.offered)
                raise
        raise failure or self._none_available(candidates)

    # -- choosing ----------------------------------------------------------------------------

    async def admit(self, backend: Backend) -> Admit:
        pool = backend.pool
        if pool is not None and pool.replica_count() == 0:
            # Scaled to zero: serve elsewhere now, wake it, and let it back in through its probe.
            if self.breakers is not None and self.breakers.state(backend.name) is State.CLOSED:
                self.breakers.trip(backend.name)
            pool.wake()
            self._skipped(backend, "cold")
            return Admit.DENY
        if self.breakers is None:
            return Admit.PASS
        admit = await self.breakers.admit(backend.name)
        if admit is Admit.DENY:
            self._skipped(backend, "breaker_open")
        return admit

    def spend_retry(self, backend: Backend, *, free: bool = False) -> bool:
        """Consent for a retry on ``backend``, counted; ``free`` (after a failed probe) does not
        draw on the budget."""
        if self.budget is None:
            return True
        now = time.monotonic()
        spent = free or self.budget.try_spend(now)
        if self.metrics is not None:
            if spent:
                self.metrics.retries.inc(tags={"backend": backend.name})
            else:
                self.metrics.retries_denied.inc()
            self.publish_budget(now)
        return spent

    def publish_budget(self, now: float | None = None) -> None:
        """``forge_retry_budget_remaining``: at each retry, and between requests (the gateway
        republishes it, ``Gateway.publish_states``) as the window refills."""
        if self.budget is not None and self.metrics is not None:
            now = time.monotonic() if now is None else now
            self.metrics.retry_budget.set(self.budget.allowed(now) - self.budget.used(now))

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

    # -- serving -----------------------------------------------------------------------------

    async def _serve(
        self, ctx: RequestContext, attempt: Attempt, candidates: Sequence[Backend]
    ) -> Response:
        budget_s = ctx.client_timeout_s
        remaining = None if budget_s is None else budget_s - (time.perf_counter() - ctx.started)
        if ctx.parsed.stream:
            return await self._stream(ctx, attempt, candidates, remaining)
        return await self._complete(ctx, attempt, candidates, remaining)

    async def _complete(
        self,
        ctx: RequestContext,
        attempt: Attempt,
        candidates: Sequence[Backend],
        budget_s: float | None,
    ) -> Response:
        backend = attempt.backend
        result = await backend.complete(ctx.body, ctx.route, ctx.key, budget_s)
        attempt.settle(ctx, Outcome.SUCCESS)
        _release_pool_slot_on_failover(ctx, backend, candidates)
        response = result["response"]
        ctx.backend, ctx.usage, ctx.completion = backend.name, response.get("usage"), response
        ctx.served_model = backend.served_model or self.served.get(backend.name)
        ctx.replica = result["replica"] or ctx.replica
        ctx.first_byte_at = time.perf_counter()
        return Response(
            orjson.dumps(response), media_type="application/json", headers=_served_by(ctx)
        )

    async def _stream(
        self,
        ctx: RequestContext,
        attempt: Attempt,
        candidates: Sequence[Backend],
        budget_s: float | None,
    ) -> Response:
        backend = attempt.backend
        stream = backend.stream(ctx.body, ctx.route, ctx.key, budget_s)
        try:
            first = await anext(stream, [])
            if first:  # a replica's refusal is its first and only batch (``Replica.stream``)
                errors.raise_if_refused(first[0])
        except BaseException:
            await stream.aclose()
            raise
        ctx.backend = backend.name
        ctx.served_model = backend.served_model or self.served.get(backend.name)
        attempt.answering(ctx)
        _release_pool_slot_on_failover(ctx, backend, candidates)
        head = take_frames(ctx, first)
        source = ClosedOnce(stream)  # the relay and the response's end both close it

        async def close_source() -> None:
            await source.aclose()
            await _charge_abandoned(ctx, backend)  # ended early: the client left, or it failed

        return EventStream(
            relay(ctx, head, source, lambda outcome: attempt.settle(ctx, outcome)),
            close_source=close_source,
            headers={**STREAM_HEADERS, **_served_by(ctx)},
        )


class _Plan:
    """The attempts one request may make, in order: planned up front as the model's backends
    (with one retry slot), and granted one at a time as the earlier ones fail.

    A backend whose breaker is open, or a pool at zero replicas, is skipped for free; a retry
    needs somewhere new to go and the retry budget's consent, except the retry of a failed
    half-open probe: there is one probe per cool-down, so its retries cannot become a storm, and
    a budget spent at the start of an outage would otherwise turn each probe into a client
    error (the failover drill saw a 502 at the first probe, 5 s into the outage).
    """

    def __init__(
        self,
        dispatch: Dispatch,
        ctx: RequestContext,
        steps: Sequence[tuple[Backend, frozenset[str]]],
    ):
        self.dispatch = dispatch
        self.ctx = ctx
        self.steps = iter(_with_retry(steps))
        self.made = 0

    async def next(self, failure: errors.ForgeError | None, probed: bool = False) -> Attempt | None:
        dispatch, ctx = self.dispatch, self.ctx
        # Why the request moves on from the step before: what the next step must be taken on.
        reason = None if failure is None else _failure_condition(failure)
        too_small = ctx.target.excluded if ctx.target is not None else ()
        for backend, on in self.steps:
            if self.made == _MAX_ATTEMPTS:
                return None
            if reason is not None and reason not in on:
                continue  # this step is not taken on that
            if backend.name in too_small:
                continue  # its context window does not take this request
            if self.made and not _another_chance(backend, ctx):
                continue
            admit = await dispatch.admit(backend)
            if admit is Admit.DENY:
                _event("forge.skipped", backend=backend.name)
                reason = reason or "breaker_open"
                ctx.first_failure = ctx.first_failure or backend.name
                continue
            if failure is not None and not dispatch.spend_retry(backend, free=probed):
                if admit is Admit.PROBE and dispatch.breakers is not None:
                    # Granted but never sent: free the probe slot for the next request.
                    dispatch.breakers.record(backend.name, Outcome.NEUTRAL, probe=True)
                return None
            self.made += 1
            _event("forge.attempt", backend=backend.name, breaker=admit.value, retry=self.made > 1)
            failed_replica, ctx.replica = ctx.replica, None
            if failed_replica and backend.pool is not None:
                backend.pool.avoid(ctx.key, failed_replica)
            breakers = dispatch.breakers
            return Attempt(
                backend,
                breakers,
                probe=admit is Admit.PROBE,
                sent_at=breakers.now() if breakers is not None else None,
            )
        return None


async def _charge_abandoned(
    ctx: RequestContext, backend: Backend, offered: tuple[str, ...] = ()
) -> None:
    """A request that ended before its usage came (a stream left mid-way; any request whose
    client left, or whose client's own deadline ran out, before the first byte, a non-streamed
    one mid-generation included): the replica aborted the generation, and the tenant is charged
    what its engine produced, not an estimate and not nothing. Shielded: it runs as the request
    is being cancelled. Where nothing can say (an external backend; a replica gone or too slow
    to answer), the request is charged the gateway's estimate, flagged, not nothing.

    A pool request whose replica is not known was cancelled before Serve heard that a replica
    took it: nothing ran, or it started on one of the replicas it was ``offered`` (the engine
    prefilled, then Serve's cancellation came). Those are asked, most likely first; none that
    answers means nothing ran, and nothing is charged."""
    if ctx.usage is not None:
        return
    pool = backend.pool
    if pool is not None and not ctx.replica:
        ctx.usage = await asyncio.shield(_cost_on_any(pool, ctx.key, offered))
        if ctx.usage is not None:
            _charged_to(ctx, backend)
        return
    _charged_to(ctx, backend)
    if pool is not None:
        ctx.usage = await asyncio.shield(pool.abandoned_usage(ctx.key, ctx.replica))
    ctx.left_uncounted = ctx.usage is None


async def _cost_on_any(pool: PoolControl, request_id: str, offered: tuple[str, ...]) -> dict | None:
    """What the request cost on whichever offered replica ran it (at most one did), in turn:
    a replica's calls about a request are pinned by its id (``PoolBridge.pinned``)."""
    for replica_id in offered:
        usage = await pool.abandoned_usage(request_id, replica_id, if_received=True)
        if usage is not None:
            return usage
    return None


def _charged_to(ctx: RequestContext, backend: Backend) -> None:
    if ctx.backend == "none":  # left before the first byte: charged to the one answering
        ctx.backend = backend.name
        ctx.served_model = ctx.served_model or backend.served_model


def _with_retry(
    steps: Sequence[tuple[Backend, frozenset[str]]],
) -> list[tuple[Backend, frozenset[str]]]:
    """Where a retry may go: the next backend; with just one, that backend again (for a pool,
    another replica: the router avoids the one that failed)."""
    return list(steps) if len(steps) > 1 else [steps[0], (steps[0][0], _ALL)]


def _all(backends: Sequence[Backend]) -> list[frozenset[str]]:
    return [_ALL] * len(backends)


def _failure_condition(err: errors.ForgeError) -> str:
    """A chain step's condition for a failure before the first byte."""
    return "first_token_timeout" if err.code == "upstream_timeout" else "error"


def _another_chance(backend: Backend, ctx: RequestContext) -> bool:
    """A retry on the pool that just failed needs another replica to go to: one that failed
    (``ctx.replica``) and another one up. A request no replica took (the pool at capacity, or
    none took it in time) would meet the same pool again."""
    if backend.pool is not None:
        return ctx.replica is not None and (backend.pool.replica_count() or 0) > 1
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


def _event(name: str, **attributes: str | int | bool) -> None:
    """An event on the dispatch span when the request is traced (a no-op otherwise)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(name, attributes)
