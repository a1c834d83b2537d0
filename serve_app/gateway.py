"""The ingress deployment: the OpenAI HTTP surface and the one place the pipeline is listed.

Request path, in order (see DESIGN.md): request id → auth → quota → cache → fair admission →
dispatch → metering. Telemetry sits right after the request id so that every outcome, a 401
included, is logged and counted once; parsing runs after auth so anonymous traffic costs only
a hash.
"""

import asyncio
import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException
from starlette.responses import Response

from serve_app import errors
from serve_app.auth import KeyRing
from serve_app.backends.base import Backend
from serve_app.backends.fallback import FallbackBackend
from serve_app.backends.pool import PoolBackend
from serve_app.config import ForgeConfig
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import Handler, RequestContext, compose
from serve_app.stages.authenticate import AuthStage
from serve_app.stages.dispatch import Dispatch
from serve_app.stages.parse import ParseStage
from serve_app.stages.request_id import RequestIdStage
from serve_app.stages.telemetry import TelemetryStage

logger = logging.getLogger("ray.serve")

app = FastAPI(title="Forge", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> Response:
    if exc.status_code == 405:
        return errors.error_response(errors.method_not_allowed(request.method, request.url.path))
    if exc.status_code == 404:
        return errors.error_response(errors.not_found(request.url.path))
    err = errors.ForgeError(exc.status_code, str(exc.detail), type="invalid_request_error")
    return errors.error_response(err)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    return errors.error_response(errors.invalid_request(str(exc)))


class Gateway:
    def __init__(self, config: dict, pools: dict[str, DeploymentHandle]) -> None:
        self.config = ForgeConfig.model_validate(config)
        self.backends = _backends(self.config, pools)
        self.models = [p.model for p in self.config.pools]
        routes: dict[str, list[Backend]] = {}
        for pool in self.config.pools:
            routes[pool.model] = [self.backends[pool.name]]
        if self.fallback is not None:
            for pool in self.config.pools:
                if pool.fallback:
                    routes[pool.model].append(self.fallback)
            routes.setdefault(self.config.fallback.model, [self.fallback])
            self.models.append(self.config.fallback.model)
        metrics = ForgeMetrics()
        keyring = KeyRing(self.config.tenants)

        # The request path, in order. Later stages (quota, cache, admission, metering) slot in
        # between auth and dispatch.
        self.serve_inference: Handler = compose(
            [
                RequestIdStage(),
                TelemetryStage(metrics),
                AuthStage(keyring),
                ParseStage(self.config.gateway.max_body_bytes),
            ],
            Dispatch(routes),
        )
        self.serve_listing: Handler = compose(
            [RequestIdStage(), TelemetryStage(metrics), AuthStage(keyring)], self._list_models
        )

    @property
    def fallback(self) -> FallbackBackend | None:
        return self.backends.get("fallback")  # type: ignore[return-value]

    async def _list_models(self, ctx: RequestContext) -> Response:
        data = [
            {"id": m, "object": "model", "created": 0, "owned_by": "forge"} for m in self.models
        ]
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    async def readiness(self) -> tuple[bool, dict[str, bool]]:
        names = list(self.backends)
        results = await asyncio.gather(*(self.backends[n].ready() for n in names))
        status = dict(zip(names, results, strict=True))
        return any(results), status


@serve.ingress(app)
class GatewayIngress(Gateway):
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self.serve_inference(RequestContext(request, "chat"))

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self.serve_inference(RequestContext(request, "completion"))

    @app.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        return await self.serve_listing(RequestContext(request, "models"))

    @app.get("/healthz")
    async def healthz(self) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/readyz")
    async def readyz(self) -> Response:
        ready, backends = await self.readiness()
        body = orjson.dumps({"ready": ready, "backends": backends})
        return Response(body, status_code=200 if ready else 503, media_type="application/json")


def _backends(config: ForgeConfig, pools: dict[str, DeploymentHandle]) -> dict[str, Backend]:
    backends: dict[str, Backend] = {
        p.name: PoolBackend(p.name, pools[p.name], p.first_token_timeout_s) for p in config.pools
    }
    if config.fallback is not None:
        backends["fallback"] = FallbackBackend(config.fallback)
    return backends
