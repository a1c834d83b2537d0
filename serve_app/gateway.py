"""The ingress deployment: the OpenAI HTTP surface and the one place the pipeline is listed.

Request path, in order (see DESIGN.md): request id → auth → quota → cache → fair admission →
dispatch → metering. Telemetry sits right after the request id so that every outcome, a 401
included, is logged and counted once; parsing runs after auth so anonymous traffic costs only
a hash.

The HTTP surface is a plain Starlette app built from a ``Gateway`` instance: Serve serves it
through ``__serve_build_asgi_app__``, and anything else (uvicorn in a profiler, a test) can
serve the very same object.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from serve_app import errors
from serve_app.auth import KeyRing, load_key_hashes_file
from serve_app.backends.base import Backend, Timeouts
from serve_app.backends.fallback import FallbackBackend
from serve_app.backends.pool import PoolBackend
from serve_app.config import ForgeConfig
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import Handler, RequestContext, compose
from serve_app.resilience import client as breaker_client
from serve_app.resilience.breaker import State
from serve_app.resilience.client import BreakerClient
from serve_app.resilience.health import HealthWatch
from serve_app.resilience.retry_budget import RetryBudget
from serve_app.resilience.settings import retry_budget_settings
from serve_app.routing.ledger import ledger
from serve_app.stages.admission import AdmissionStage
from serve_app.stages.authenticate import AuthStage
from serve_app.stages.dispatch import Dispatch
from serve_app.stages.parse import ParseStage
from serve_app.stages.quota import QuotaStage
from serve_app.stages.request_id import RequestIdStage
from serve_app.stages.telemetry import TelemetryStage
from serve_app.store import build_store

logger = logging.getLogger("ray.serve")

_JSON = "application/json"


class Gateway:
    def __init__(
        self,
        config: dict,
        pools: dict[str, DeploymentHandle],
        schedulers: dict[str, DeploymentHandle] | None = None,
        board: DeploymentHandle | None = None,
    ) -> None:
        self.config = ForgeConfig.model_validate(config)
        metrics = ForgeMetrics()
        resilience = self.config.resilience
        self.breakers = BreakerClient(
            _board_call(board) if board is not None else None,
            resilience.sync_interval_s,
            on_board_error=lambda op: metrics.board_errors.inc(tags={"op": op}),
        )
        breaker_client.install(self.breakers)  # the pools' routers read it in this process
        self.backends = _backends(self.config, pools)
        fallback = self.backends.get("fallback")
        self.fallback_health = (
            HealthWatch(
                "fallback", fallback.ready, resilience.fallback_probe_interval_s, self.breakers
            )
            if fallback is not None
            else None
        )
        routes: dict[str, list[Backend]] = {}
        for pool in self.config.pools:
            routes[pool.model] = [self.backends[pool.name]]
            if fallback is not None and pool.fallback:
                routes[pool.model].append(fallback)
        if fallback is not None:
            routes.setdefault(self.config.fallback.model, [fallback])
        self.models = list(routes)
        keyring = _keyring(self.config)
        store_config = self.config.store
        self.store = build_store(
            store_config.resolved_url(),
            key_prefix=store_config.key_prefix,
            timeout_s=store_config.timeout_s,
        )
        default_max_tokens = {p.model: p.default_max_tokens for p in self.config.pools}
        admitted = [p for p in self.config.pools if p.name in (schedulers or {})]
        admission = AdmissionStage(
            {p.model: schedulers[p.name] for p in admitted},
            {p.model: p.admission.deadline_s for p in admitted},
            metrics,
        )

        # The request path, in order. The response cache (a later stage) slots in between quota
        # and admission, so a hit costs no slot.
        self.serve_inference: Handler = compose(
            [
                RequestIdStage(),
                TelemetryStage(metrics),
                AuthStage(keyring),
                ParseStage(self.config.gateway.max_body_bytes),
                QuotaStage(self.store, metrics, self.config.tenants, default_max_tokens),
                admission,
            ],
            Dispatch(
                routes,
                self.breakers,
                RetryBudget(retry_budget_settings(resilience.retry_budget)),
                metrics,
            ),
        )
        self.serve_listing: Handler = compose(
            [RequestIdStage(), TelemetryStage(metrics), AuthStage(keyring)], self._list_models
        )

    def asgi_app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/healthz", self.healthz, methods=["GET"]),
                Route("/readyz", self.readyz, methods=["GET"]),
            ],
            exception_handlers={HTTPException: _http_error},
        )

    async def chat_completions(self, request: Request) -> Response:
        return await self.serve_inference(RequestContext(request, "chat"))

    async def completions(self, request: Request) -> Response:
        return await self.serve_inference(RequestContext(request, "completion"))

    async def list_models(self, request: Request) -> Response:
        return await self.serve_listing(RequestContext(request, "models"))

    async def healthz(self, request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=_JSON)

    async def readyz(self, request: Request) -> Response:
        """Ready while some backend can serve: a pool with a replica up and its breaker not
        open, or a healthy fallback whose breaker is not open."""
        names = list(self.backends)
        results = await asyncio.gather(*(self._backend_ready(n) for n in names))
        body = {"ready": any(results), "backends": dict(zip(names, results, strict=True))}
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
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "forge"} for m in self.models
        ]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type=_JSON)


@serve.ingress()
class GatewayIngress(Gateway):
    def __serve_build_asgi_app__(self) -> Starlette:
        return self.asgi_app()


async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 405:
        return errors.error_response(errors.method_not_allowed(request.method, request.url.path))
    if exc.status_code == 404:
        return errors.error_response(errors.not_found(request.url.path))
    err = errors.ForgeError(exc.status_code, str(exc.detail), type="invalid_request_error")
    return errors.error_response(err)


def _keyring(config: ForgeConfig) -> KeyRing:
    extra = {}
    if config.key_hashes_file:
        extra = load_key_hashes_file(config.key_hashes_file, [t.name for t in config.tenants])
    return KeyRing(config.tenants, extra)


def _backends(config: ForgeConfig, pools: dict[str, DeploymentHandle]) -> dict[str, Backend]:
    backends: dict[str, Backend] = {
        p.name: PoolBackend(
            p.name,
            pools[p.name],
            Timeouts(
                p.connect_timeout_s,
                p.first_token_timeout_s,
                p.idle_timeout_s,
                p.request_timeout_s,
            ),
            ledger(p.name),
        )
        for p in config.pools
    }
    if config.fallback is not None:
        backends["fallback"] = FallbackBackend(config.fallback)
    return backends


def _board_call(board: DeploymentHandle):
    async def call(method: str, *args):
        return await getattr(board, method).remote(*args)

    return call
