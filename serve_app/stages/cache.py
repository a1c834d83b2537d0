"""The response cache stage: after quota, before admission (a hit costs no slot, no backend).

A deterministic request (``stages/cache_rules.py`` says which) is looked up under its tenant's
scope. A hit is answered here, as JSON or as a stream, and settles the quota to the cached
usage like any answer. A miss goes on; its answer is kept only if the pool itself served it,
completely and plainly (never the fallback's, never a stream that failed or that the client
left), and only after the response has ended. Every answer says ``x-forge-cache: hit``,
``miss`` or ``bypass``. The store fails open: a lookup that fails is a bypass, counted.

A stream's answer is gathered as it passes, its text only (``StreamedAnswer``): a cacheable
stream costs at most ``max_entry_bytes`` of memory, and one that outgrows it stops being
gathered at once (``forge_cache_stores_total{result="too_large"}``).

The shared scope does not tell tenants about each other. A hit on a shared entry that another
tenant wrote would say that someone sent exactly this prompt before; so it is answered as the
miss that wrote it was: ``x-forge-cache: miss`` and that miss's backend and replica headers, the
text a chunk per token, and the writer's pace (its time to first byte, then the rest spread
over its duration; a JSON answer after its duration). What the tenant can compare it with is
then what a miss costs it; all it saves is the GPU's work, which is the shared scope's point.
Only the writer is told "hit". For the books it is a hit all the same (``ctx.cache``: metered
as a cached request, counted in ``forge_cache_hits_total``), which a tenant reading its own
usage report sees a day's total of, never which request it was. What stays different: a hit
never waits in fair admission, so under contention a miss may be refused (429) where a hit is
not; and the JSON shape is the simulated engine's (a vLLM pool's answers carry a few more
null fields).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import orjson
from starlette.responses import Response

from serve_app.adapters import adapter_model
from serve_app.config.models import CacheConfig
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import EventStream, Handler, RequestContext, on_response_end
from serve_app.stages.cache_rules import (
    CachedAnswer,
    Provenance,
    StreamedAnswer,
    bypass_reason,
    cache_key,
)
from serve_app.stages.relay import STREAM_HEADERS
from serve_app.stages.store_failures import StoreFailures
from serve_app.store import Store, StoreError

HEADER = "x-forge-cache"
SHARED = "shared"


@dataclass(frozen=True, slots=True)
class CachedPool:
    """What a model's answers depend on besides the request, and whose answers may be kept."""

    backend: str  # the pool's backend name: the only one whose answers are stored
    # What the pool runs, now: its config's (a pool in the gateway's application), or what its
    # replicas report (a pool in an application of its own, which may roll under the gateway);
    # None while unknown or changing, and the request bypasses the cache.
    engine_identity: Callable[[], str | None]


class CacheStage:
    def __init__(
        self,
        store: Store,
        metrics: ForgeMetrics,
        config: CacheConfig,
        pools: Mapping[str, CachedPool],  # served model → its pool
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.config = config
        self.pools = pools
        self._storing: set[asyncio.Task] = set()
        self._store_failed = StoreFailures(metrics, "serving uncached")

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        model = ctx.pool_model  # the variant's pool: its answers are its own
        pool = self.pools.get(model)
        reason = (
            bypass_reason(ctx.body, ctx.request.headers.get("cache-control"))
            if pool is not None
            else "model"  # served by the fallback alone: nothing of it is ever kept
        )
        identity = pool.engine_identity() if reason is None else None
        if identity is None:  # not cacheable, or what the pool runs is not known right now
            return await self._bypass(ctx, call_next, ctx.model_label)
        scope = SHARED if ctx.tenant.cache_scope == "shared" else "tenant:" + ctx.tenant.name
        # An adapter's answers are its own: keyed by it, never replayed for the base model.
        key = cache_key(scope, adapter_model(model, ctx.adapter), identity, ctx.route, ctx.body)
        try:
            raw = await self.store.cache_get(key)
        except StoreError as exc:
            self._store_failed("cache_get", exc)
            self.metrics.cache.inc(tags={"model": model, "result": "error"})
            return await self._bypass(ctx, call_next, model, count=False)
        answer = CachedAnswer.decode(raw) if raw is not None else None
        if answer is not None:
            written = answer.provenance
            if written is not None and written.writer != ctx.tenant.name:
                return await self._hit_as_a_miss(ctx, answer, written, pool)
            return self._hit(ctx, answer)

        self.metrics.cache.inc(tags={"model": model, "result": "miss"})
        ctx.cache = "miss"
        if ctx.parsed.stream:
            ctx.gathered = StreamedAnswer(ctx.route, self.config.max_entry_bytes)
        response = await call_next(ctx)
        response.headers[HEADER] = "miss"
        shared = scope == SHARED
        return on_response_end(
            response, lambda completed: self._keep(ctx, pool, key, completed, shared)
        )

    async def _bypass(
        self, ctx: RequestContext, call_next: Handler, model: str, *, count: bool = True
    ) -> Response:
        if count:
            self.metrics.cache.inc(tags={"model": model, "result": "bypass"})
        ctx.cache = "bypass"
        response = await call_next(ctx)
        response.headers[HEADER] = "bypass"
        return response

    def _counted_hit(self, ctx: RequestContext, answer: CachedAnswer) -> None:
        """A hit for the books and the operator's metrics, however it is told to the client."""
        self.metrics.cache.inc(tags={"model": ctx.parsed.model, "result": "hit"})
        self.metrics.cache_hits.inc(tags={"tenant": ctx.tenant.name})
        ctx.cache, ctx.backend, ctx.usage = "hit", "cache", answer.usage

    def _hit(self, ctx: RequestContext, answer: CachedAnswer) -> Response:
        self._counted_hit(ctx, answer)
        ctx.first_byte_at = time.perf_counter()
        headers = {HEADER: "hit", "x-forge-backend": "cache"}
        if not ctx.parsed.stream:
            body = orjson.dumps(answer.response(ctx.request_id))
            return Response(body, media_type="application/json", headers=headers)
        frames = answer.frames(ctx.request_id, ctx.parsed.include_usage)
        # An EventStream, as dispatch's: its end is seen however the client leaves.
        return EventStream(
            _replay(frames), close_source=_nothing, headers={**STREAM_HEADERS, **headers}
        )

    async def _hit_as_a_miss(
        self, ctx: RequestContext, answer: CachedAnswer, written: Provenance, pool: CachedPool
    ) -> Response:
        """Another tenant's shared entry, told as the miss that wrote it (module docstring)."""
        self._counted_hit(ctx, answer)
        headers = {HEADER: "miss", "x-forge-backend": pool.backend}
        if written.replica:
            headers["x-forge-replica"] = written.replica
        # The id a miss's answer carries is the engine's, made from Forge's own key for the
        # request (``ctx.key``), not the client's ``x-request-id`` that a plain hit echoes.
        if not ctx.parsed.stream:
            await asyncio.sleep(written.duration_s)
            ctx.first_byte_at = time.perf_counter()
            body = orjson.dumps(answer.response(ctx.key))
            return Response(body, media_type="application/json", headers=headers)
        frames = answer.frames(ctx.key, ctx.parsed.include_usage, per_token=True)
        return EventStream(
            _paced(ctx, frames, written),
            close_source=_nothing,
            headers={**STREAM_HEADERS, **headers},
        )

    def _keep(
        self, ctx: RequestContext, pool: CachedPool, key: str, completed: bool, shared: bool
    ) -> None:
        """Store a miss's answer if it is one to replay: complete, plain, from the pool."""
        gathered, ctx.gathered = ctx.gathered, None
        if not completed or ctx.stream_error or ctx.backend != pool.backend or not ctx.usage:
            return
        if gathered is not None and gathered.dropped is not None:
            self.metrics.cache_stores.inc(tags={"result": gathered.dropped})
            return
        if gathered is None:
            answer = CachedAnswer.from_response(ctx.route, ctx.completion or {})
        else:
            answer = gathered.answer(ctx.parsed.model, ctx.usage)
        if answer is None:
            self.metrics.cache_stores.inc(tags={"result": "not_plain"})
            return
        if shared:
            answer = answer.written_by(_provenance(ctx, gathered))
        value = answer.encode()
        if len(value) > self.config.max_entry_bytes:
            self.metrics.cache_stores.inc(tags={"result": "too_large"})
            return
        task = asyncio.get_running_loop().create_task(self._put(key, value))
        self._storing.add(task)
        task.add_done_callback(self._storing.discard)

    async def _put(self, key: str, value: bytes) -> None:
        try:
            await self.store.cache_put(key, value, self.config.ttl_s)
        except StoreError as exc:
            self._store_failed("cache_put", exc)
            self.metrics.cache_stores.inc(tags={"result": "error"})
            return
        self.metrics.cache_stores.inc(tags={"result": "stored"})


async def _replay(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


def _provenance(ctx: RequestContext, gathered: StreamedAnswer | None) -> Provenance:
    """Who wrote this shared entry, and the pace its miss was served at."""
    first = ctx.first_byte_at if ctx.first_byte_at is not None else time.perf_counter()
    ttft_s = max(first - ctx.started, 0.0)
    if gathered is None:  # a JSON answer: all of it came at once
        return Provenance(ctx.tenant.name, ctx.replica, None, ttft_s)
    last = gathered.last_at if gathered.last_at is not None else first
    return Provenance(ctx.tenant.name, ctx.replica, ttft_s, max(last - ctx.started, ttft_s))


async def _paced(
    ctx: RequestContext, frames: list[bytes], written: Provenance
) -> AsyncIterator[bytes]:
    """``frames`` at the writer's pace: the first at its time to first byte (a JSON writer's:
    its share of the duration), the rest spread evenly until its duration."""
    loop = asyncio.get_running_loop()
    start = loop.time() - (time.perf_counter() - ctx.started)  # the request's start, loop time
    total = written.duration_s
    first = written.ttft_s if written.ttft_s is not None else total / len(frames)
    for i, frame in enumerate(frames):
        due = first + (total - first) * i / max(len(frames) - 1, 1)
        delay = start + due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if i == 0:
            ctx.first_byte_at = time.perf_counter()
        yield frame


async def _nothing() -> None:
    """A replayed answer has no generation to abort."""
