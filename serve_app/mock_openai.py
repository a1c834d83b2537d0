"""A mock OpenAI-compatible server, so the laptop exercises the fallback over real HTTP.

It is the simulated engine behind a plain OpenAI HTTP surface, run as a second Serve
application on its own route prefix; the gateway's fallback client cannot tell it from Gemini's
OpenAI-compatible endpoint (it also checks the bearer key when one is configured).
"""

import hmac
import os
from typing import Any

import orjson
from fastapi import FastAPI, Request
from ray import serve
from ray.serve import Application
from starlette.responses import Response, StreamingResponse

from serve_app import errors, protocol, sse
from serve_app.config import SimulatedEngineConfig
from serve_app.engines.base import Kind, Usage
from serve_app.engines.simulated import SimulatedEngine

mock_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
_MODELS = {"chat": protocol.ChatCompletionRequest, "completion": protocol.CompletionRequest}


@serve.ingress(mock_app)
class MockOpenAI:
    def __init__(self, model: str, engine: dict, api_key_env: str | None = None) -> None:
        self.model = model
        self.engine = SimulatedEngine(model, SimulatedEngineConfig.model_validate(engine), 256)
        self.api_key = os.environ.get(api_key_env) if api_key_env else None

    @mock_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return Response(
            orjson.dumps({"object": "list", "data": [{"id": self.model, "object": "model"}]}),
            media_type="application/json",
        )

    @mock_app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    @mock_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def _serve(self, request: Request, kind: Kind) -> Response:
        try:
            self._check_key(request.headers.get("authorization", ""))
            body, parsed = protocol.parse_request(await request.body(), _MODELS[kind])
            if parsed.model != self.model:
                raise errors.model_not_found(parsed.model)
            request_id = request.headers.get("x-request-id") or "mock"
            if not parsed.stream:
                response, _ = await self.engine.complete(body, kind, request_id)
                return Response(orjson.dumps(response), media_type="application/json")
            return StreamingResponse(
                self._stream(body, kind, request_id), media_type="text/event-stream"
            )
        except errors.ForgeError as err:
            return errors.error_response(err)

    async def _stream(self, body: dict, kind: Kind, request_id: str):
        async for item in self.engine.stream(body, kind, request_id):
            if not isinstance(item, Usage):
                yield item
        yield sse.DONE

    def _check_key(self, authorization: str) -> None:
        if self.api_key is None:
            return
        if not hmac.compare_digest(authorization, f"Bearer {self.api_key}"):
            raise errors.invalid_api_key()


def build_mock(args: dict[str, Any]) -> Application:
    deployment = serve.deployment(MockOpenAI).options(
        name="mock-openai", ray_actor_options={"num_cpus": 0}
    )
    return deployment.bind(
        args.get("model", "mock-gemini"), args.get("engine", {}), args.get("api_key_env")
    )
