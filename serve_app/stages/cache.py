"""The response cache stage: after quota, before admission (a hit costs no slot, no backend).

A deterministic request (``stages/cache_rules.py`` says which) is looked up under its tenant's
scope. A hit is answered here, as JSON or as a stream, and settles the quota to the cached
usage like any answer. A miss goes on; its answer is kept only if the pool itself served it,
completely and plainly (never the fallback's, never a stream that failed or that the client
left), and only after the response has ended. Every answer says ``x-forge-cache: hit``,
``miss`` or ``bypass``. The store fails open: a lookup that fails is a bypass, counted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import orjson
from starlette.responses import Response

from serve_app.config.models import CacheConfig
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import EventStream, Handler, RequestContext, on_response_end
from serve_app.stages.cache_rules import CachedAnswer, bypass_reason, cache_key
from serve_app.stages.store_failures import StoreFailures
from serve_app.store import Store, StoreError

HEADER = "x-forge-cache"
_FRAMES_PER_ENTRY_BYTE = 32


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
        model = ctx.parsed.model
        pool = self.pools.get(model)
        reason = (
            bypass_reason(ctx.body, ctx.request.headers.get("cache-control"))
            if pool is not None
            else "model"  # served by the fallback alone: nothing of it is ever kept
        )
        identity = pool.engine_identity() if reason is None else None
        if identity is None:  # not cacheable, or what the pool runs is not known right now
            return await self._bypass(ctx, call_next, ctx.model_label)
        scope = "shared" if ctx.tenant.cache_scope == "shared" else "tenant:" + ctx.tenant.name
        key = cache_key(scope, model, identity, ctx.route, ctx.body)
        try:
            raw = await self.store.cache_get(key)
        except StoreError as exc:
            self._store_failed("cache_get", exc)
            self.metrics.cache.inc(tags={"model": model, "result": "error"})
            return await self._bypass(ctx, call_next, model, count=False)
        answer = CachedAnswer.decode(raw) if raw is not None else None
        if answer is not None:
            return self._hit(ctx, answer)

        self.metrics.cache.inc(tags={"model": model, "result": "miss"})
        ctx.cache = "miss"
        if ctx.parsed.stream:
            # The frames' JSON envelopes are ~30x the text they carry (a token is a chunk), so
            # a stream under this many bytes of frames can make an entry under the cap.
            ctx.frames, ctx.frames_budget = [], _FRAMES_PER_ENTRY_BYTE * self.config.max_entry_bytes
        response = await call_next(ctx)
        response.headers[HEADER] = "miss"
        return on_response_end(response, lambda completed: self._keep(ctx, pool, key, completed))

    async def _bypass(
        self, ctx: RequestContext, call_next: Handler, model: str, *, count: bool = True
    ) -> Response:
        if count:
            self.metrics.cache.inc(tags={"model": model, "result": "bypass"})
        ctx.cache = "bypass"
        response = await call_next(ctx)
        response.headers[HEADER] = "bypass"
        return response

    def _hit(self, ctx: RequestContext, answer: CachedAnswer) -> Response:
        self.metrics.cache.inc(tags={"model": ctx.parsed.model, "result": "hit"})
        self.metrics.cache_hits.inc(tags={"tenant": ctx.tenant.name})
        ctx.cache, ctx.backend, ctx.usage = "hit", "cache", answer.usage
        ctx.first_byte_at = time.perf_counter()
        headers = {HEADER: "hit", "x-forge-backend": "cache"}
        if not ctx.parsed.stream:
            body = orjson.dumps(answer.response(ctx.request_id))
            return Response(body, media_type="application/json", headers=headers)
        frames = answer.frames(ctx.request_id, ctx.parsed.include_usage)
        # An EventStream, as dispatch's: its end is seen however the client leaves.
        return EventStream(
            _replay(frames),
            close_source=_nothing,
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", **headers},
        )

    def _keep(self, ctx: RequestContext, pool: CachedPool, key: str, completed: bool) -> None:
        """Store a miss's answer if it is one to replay: complete, plain, from the pool."""
        frames, ctx.frames = ctx.frames, None
        if not completed or ctx.stream_error or ctx.backend != pool.backend or not ctx.usage:
            return
        if ctx.parsed.stream and frames is None:
            self.metrics.cache_stores.inc(tags={"result": "too_large"})
            return
        if frames is None:
            answer = CachedAnswer.from_response(ctx.route, ctx.completion or {})
        else:
            answer = CachedAnswer.from_frames(ctx.route, ctx.parsed.model, frames, ctx.usage)
        if answer is None:
            self.metrics.cache_stores.inc(tags={"result": "not_plain"})
            return
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


async def _nothing() -> None:
    """A replayed answer has no generation to abort."""
