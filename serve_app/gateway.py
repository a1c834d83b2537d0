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
from serve_app.backends.base import Backend
from serve_app.backends.fallback import FallbackBackend
from serve_app.backends.pool import PoolBackend
from serve_app.config import ForgeConfig
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import Handler, RequestContext, compose
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
    ) -> None:
        self.config = ForgeConfig.model_validate(config)
        self.backends = _backends(self.config, pools)
        fallback = self.backends.get("fallback")
        routes: dict[str, list[Backend]] = {}
        for pool in self.config.pools:
            routes[pool.model] = [self.backends[pool.name]]
            if fallback is not None and pool.fallback:
                routes[pool.model].append(fallback)
        if fallback is not None:
            routes.setdefault(self.config.fallback.model, [fallback])
        self.models = list(routes)
        metrics = ForgeMetrics()
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
            Dispatch(routes),
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
        names = list(self.backends)
        results = await asyncio.gather(*(self.backends[n].ready() for n in names))
        body = {"ready": any(results), "backends": dict(zip(names, results, strict=True))}
        return Response(
            orjson.dumps(body), status_code=200 if body["ready"] else 503, media_type=_JSON
        )

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
            p.name, pools[p.name], p.first_token_timeout_s, p.idle_timeout_s, p.request_timeout_s
        )
        for p in config.pools
    }
    if config.fallback is not None:
        backends["fallback"] = FallbackBackend(config.fallback)
    return backends
