"""The gateway: the OpenAI HTTP surface over the pipeline, given its collaborators.

``Gateway`` builds nothing that talks to the outside world: the store, the key ring, the
backends, the schedulers' clients and the breaker client are handed in (``gateway/ingress.py``
wires Serve handles into them; ``serve_app/local.py`` wires in-process ones), so the very same
object is served by Serve, by uvicorn, or by httpx's ``ASGITransport`` in a test without Ray.
The pipeline itself is listed in ``serve_app/stack.py``.

Background work (the fallback's health probe, the breaker sync) starts with the app's lifespan,
not with the first request, and stops with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from serve_app import errors
from serve_app.admin.api import build_admin_api, http_error
from serve_app.auth.keys import KeyRing
from serve_app.config.models import ForgeConfig
from serve_app.dialects.messages import speaks_anthropic
from serve_app.gateway import catalog
from serve_app.gateway.live import LiveUpdates
from serve_app.gateway.request_limits import RequestLimits
from serve_app.metering.ledger import UsageLedger
from serve_app.pipeline import RequestContext
from serve_app.resilience.breaker import State
from serve_app.resilience.health import HealthWatch
from serve_app.resilience.settings import breaker_client_options
from serve_app.stack import Collaborators, Pipeline, build_lasting, build_pipeline
from serve_app.store.guarded import GuardedStore
from serve_app.traffic.policy import TrafficPolicy

logger = logging.getLogger("ray.serve")

_JSON = "application/json"
STATES_EVERY_S = 5.0  # how often the state gauges are set again (``Gateway.publish_states``)


class Gateway:
    def __init__(self, config: ForgeConfig, parts: Collaborators) -> None:
        self.config = config
        self.store = parts.store
        self.backends = dict(parts.backends)  # pool name (or "fallback") → backend
        self.breakers = parts.breakers
        fallback = self.backends.get("fallback")
        self.fallback_health = (
            HealthWatch(
                "fallback",
                fallback.ready,
                config.resilience.fallback_probe_interval_s,
                parts.breakers,
            )
            if fallback is not None
            else None
        )
        self.keyring = parts.keyring
        self.metrics = parts.metrics
        self.schedulers = dict(parts.schedulers)
        # Every name served: pools' models, the fallback's, models: entries, adapters (for
        # /v1/models, each tenant's own list).
        self.models = TrafficPolicy(config)
        self._parts = parts
        self._app: Starlette | None = None
        self._states_task: asyncio.Task | None = None
        self.lasting = build_lasting(config, parts)  # kept across live changes
        self.pipeline = self._build_pipeline(config, parts)
        # The args' configuration is the base a live change's sections go over.
        self.live = LiveUpdates(
            config,
            self.apply,
            self.metrics,
            self.schedulers,
            self.breakers,
            peers=self.served_by_a_peer,
        )

    def _build_pipeline(self, config: ForgeConfig, parts: Collaborators) -> Pipeline:
        return build_pipeline(config, parts, self.lasting, list_models=self._list_models)

    @property
    def ledger(self) -> UsageLedger:
        return self.lasting.ledger

    # -- live configuration (``gateway/live.py`` validates, refuses, counts and pushes) ------

    async def reconfigure(self, user_config: dict) -> None:
        """Serve calls this with the gateway deployment's ``user_config`` when a replica starts
        and whenever it changes (``serve deploy``), without replacing the replica."""
        await self.live.reconfigure(user_config)

    async def served_user_config(self) -> dict | None:
        """The live change this replica serves: what a replica starting on a bad target
        serves instead (``LiveUpdates``, through a handle to this deployment)."""
        return self.live.user_config

    async def served_by_a_peer(self) -> dict | None:
        """What another replica of this gateway serves; in one process there is none."""
        return None

    def apply(self, config: ForgeConfig) -> None:
        """Serve ``config``'s tenants, keys, limits, admission and breaker settings from the
        next request on (``serve_app/config/live.py`` says which fields may change so).

        Atomic for requests: everything a request reads of the configuration hangs off the
        pipeline it started in, and the new pipeline, key ring and admin routes are swapped in
        with no await in between, so a request sees the old set or the new one, never a mix.
        Requests under way finish under the old one. What lives across requests is kept: the
        store's budgets and cache, the ``LastingParts`` (usage ledger, auth throttle, parked
        slots), the breakers' states; the schedulers and the board hear of it from ``live``.
        """
        keyring = KeyRing.from_config(config)  # reads a mounted key file again: it may rotate
        parts = replace(self._parts, keyring=keyring)
        pipeline = self._build_pipeline(config, parts)
        admin = self._admin_api(config, keyring) if self._app is not None else None
        models = TrafficPolicy(config)
        # The swap: no await from here to the end.
        self.lasting.retune(config)
        self.config, self.keyring, self._parts, self.pipeline = config, keyring, parts, pipeline
        self.models = models
        if self._app is not None:
            self._app.router.default = admin
        self.breakers.configure(**breaker_client_options(config.resilience))

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background work: the fallback is probed from now on, idle or not, and
        the schedulers and the board hear this replica's live settings."""
        if self.fallback_health is not None:
            self.fallback_health.start()
        self.live.start()
        self.lasting.ledger.start()  # and dead replicas' usage journals are adopted
        if self._states_task is None:
            self._states_task = asyncio.get_running_loop().create_task(self._publish_states())

    async def _publish_states(self) -> None:
        while True:
            await asyncio.sleep(STATES_EVERY_S)
            self.publish_states()

    def publish_states(self) -> None:
        """The state gauges again: the stores' breakers and the retry budget's remainder. They
        change on a failure or a retry, and Ray's export drops a gauge nobody set for two
        periods, so a store breaker left open would vanish from the dashboard (as the board's
        breakers did), and the budget would show its last retry's remainder for ever."""
        stores = {"main": self.store}
        if self._parts.cache_store is not None and self._parts.cache_store is not self.store:
            stores["cache"] = self._parts.cache_store
        for name, store in stores.items():
            if isinstance(store, GuardedStore):
                self.metrics.store_changed(name, store.state)
        self.pipeline.dispatch.publish_budget()

    async def aclose(self) -> None:
        self.live.stop()
        if self._states_task is not None:
            self._states_task.cancel()
        for stage in self.pipeline.stages:
            close = getattr(stage, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
        await self.lasting.shadows.aclose()
        await self.lasting.settles.aclose()  # what tenants are owed lands before the store goes
        await self.lasting.ledger.aclose()  # and the usage queued reaches the ledger
        if self.fallback_health is not None:
            await self.fallback_health.aclose()
        await self.breakers.aclose()
        for backend in self.backends.values():
            close = getattr(backend, "aclose", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    await close()
        parts = self._parts
        stores = (self.store, parts.usage_store or self.store, parts.cache_store or self.store)
        for store in {id(s): s for s in stores}.values():
            with contextlib.suppress(Exception):
                await store.close()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette | None = None) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.aclose()

    # -- HTTP --------------------------------------------------------------------------------

    def asgi_app(self) -> Starlette:
        """The inference routes on plain Starlette (the hot path pays for no FastAPI), and the
        usage/admin API (``serve_app/admin/api.py``, with ``/openapi.json`` and ``/docs``) for
        every path they do not match.

        The admin app is the router's default, not a ``Mount("")``: a catch-all mount is a full
        match, which beats a route's partial (path-only) match, so ``GET /v1/chat/completions``
        would become the admin app's 404 instead of the 405 it is.
        """
        app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/embeddings", self.embeddings, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/responses/input_tokens", self.input_tokens, methods=["POST"]),
                Route(
                    "/v1/responses/{response_id}", self.stored_response, methods=["GET", "DELETE"]
                ),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.list_models, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/readyz", self.readyz, methods=["GET"]),
            ],
            exception_handlers={HTTPException: http_error},
            middleware=[
                Middleware(
                    RequestLimits,
                    max_bytes=self.config.gateway.max_header_bytes,
                    max_body_bytes=self.config.gateway.max_body_bytes,
                    body_timeout_s=self.config.gateway.body_timeout_s,
                )
            ],
            lifespan=self.lifespan,
        )
        app.router.default = self._admin_api(self.config, self.keyring)
        self._app = app
        return app

    def _admin_api(self, config: ForgeConfig, keyring: KeyRing):
        pools = {name: b.pool for name, b in self.backends.items() if b.pool is not None}
        return build_admin_api(
            config,
            keyring,
            self.ledger,
            self.breakers,
            pools,
            status=self.status,
            auth_throttle=self.lasting.auth_throttle,
        )

    async def chat_completions(self, request: Request) -> Response:
        return await self.pipeline.inference(RequestContext(request, "chat"))

    async def completions(self, request: Request) -> Response:
        return await self.pipeline.inference(RequestContext(request, "completion"))

    async def embeddings(self, request: Request) -> Response:
        return await self.pipeline.inference(RequestContext(request, "embedding"))

    async def responses(self, request: Request) -> Response:
        return await self._spoken(RequestContext(request, "chat", "responses", "responses"))

    async def stored_response(self, request: Request) -> Response:
        if request.path_params["response_id"] == "input_tokens":  # the count's path, not an id
            raise HTTPException(405, headers={"Allow": "POST"})
        return await self.pipeline.stored_response(RequestContext(request, "responses"))

    async def messages(self, request: Request) -> Response:
        return await self._spoken(RequestContext(request, "chat", "messages", "messages"))

    async def count_tokens(self, request: Request) -> Response:
        ctx = RequestContext(request, "chat", "count_tokens", "messages")
        pipeline = self.pipeline
        return await pipeline.dialects["messages"].answer(ctx, await pipeline.count_tokens(ctx))

    async def input_tokens(self, request: Request) -> Response:
        ctx = RequestContext(request, "chat", "input_tokens", "responses")
        pipeline = self.pipeline
        return await pipeline.dialects["responses"].answer(ctx, await pipeline.count_tokens(ctx))

    async def _spoken(self, ctx: RequestContext) -> Response:
        """A request in a dialect: through the whole pipeline as chat, answered in its API's
        shape (errors included) by the pipeline it started in."""
        pipeline = self.pipeline
        return await pipeline.dialects[ctx.dialect].answer(ctx, await pipeline.inference(ctx))

    async def list_models(self, request: Request) -> Response:
        """``/v1/models`` and ``/v1/models/{model}``; to Anthropic's SDK in its own shape,
        errors included."""
        if not speaks_anthropic(request):
            return await self.pipeline.listing(RequestContext(request, "models"))
        ctx = RequestContext(request, "models", "models", "messages")
        pipeline = self.pipeline
        return await pipeline.dialects["messages"].answer(ctx, await pipeline.listing(ctx))

    async def status(self) -> dict:
        """What ``GET /admin/status`` shows of this gateway replica: its store, the store errors
        it counted, and each pool's replicas (as its router knows them) and admission slots."""
        breaker = getattr(self.store, "state", None)  # a guarded store's breaker (Redis)
        pools = []
        for pool in self.config.pools:
            scheduler = self.schedulers.get(pool.name)
            admission = None
            if scheduler is not None:
                try:
                    admission = await scheduler.snapshot()
                except Exception as exc:  # the scheduler deployment is down: say so, not 500
                    logger.warning("scheduler %s snapshot failed: %r", pool.name, exc)
            pools.append(
                {
                    "name": pool.name,
                    "model": pool.model,
                    "replicas": self.backends[pool.name].pool.replica_count(),
                    "fallback": pool.fallback and "fallback" in self.backends,
                    "admission": admission,
                }
            )
        return {
            "store": {
                "kind": "redis" if self.config.store.shared else "embedded",
                "state": breaker.name.lower() if breaker is not None else "closed",
                "errors": dict(self.metrics.store_errors_seen),
            },
            "pools": pools,
            "fallback": self.config.fallback.model if self.config.fallback else None,
            "faults": self.config.faults.enabled,  # POST /admin/faults on (drills) or off
            # The live configuration this replica serves, and the last change it refused.
            "config": self.live.status,
            # Each models: entry's variants: weights, windows, the analysis' verdict.
            "traffic": self.lasting.watch.status(),
            "shadow": dict(self.lasting.shadows.counts),  # "model/pool/status" → copies
        }

    async def healthz(self, request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=_JSON)

    async def readyz(self, request: Request) -> Response:
        """Ready while some backend can serve: a pool with a replica up and its breaker not
        open, or a healthy fallback whose breaker is not open. ``config`` says whether this
        replica serves its target configuration or refused it (and serves the last good one):
        said, not failed, since a replica replaced for it would start on the same bad target."""
        names = list(self.backends)
        results = await asyncio.gather(*(self._backend_ready(n) for n in names))
        body = {
            "ready": any(results),
            "backends": dict(zip(names, results, strict=True)),
            "config": "refused" if self.live.refused else "current",
        }
        return Response(
            orjson.dumps(body), status_code=200 if body["ready"] else 503, media_type=_JSON
        )

    async def _backend_ready(self, name: str) -> bool:
        if self.breakers.state(name) is State.OPEN:
            return False
        if name == "fallback" and self.fallback_health is not None:
            return await self.fallback_health.current()
        return await self.backends[name].ready()

    async def _list_models(self, ctx: RequestContext) -> Response:
        """The names ``ctx``'s tenant may call (``gateway/catalog.py``); one of them, where the
        path names it: any other is a 404, whether it exists or is someone else's."""
        policy, anthropic = self.models, ctx.dialect == "messages"
        card = catalog.anthropic_card if anthropic else catalog.openai_card
        names = policy.listed(ctx.tenant)
        asked = ctx.request.path_params.get("model")
        if asked is not None:
            if asked not in names:
                raise errors.model_not_found(asked)
            body = card(policy, asked)
        elif anthropic:
            cards = [card(policy, m) for m in names]
            body = catalog.anthropic_page(cards, ctx.request.query_params)
        else:
            body = {"object": "list", "data": [card(policy, m) for m in names]}
        return Response(orjson.dumps(body), media_type=_JSON)
