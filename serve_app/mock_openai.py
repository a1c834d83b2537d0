"""A mock OpenAI-compatible server, so the laptop exercises the fallback over real HTTP.

It is the simulated engine behind a plain OpenAI HTTP surface. ``configs/local.yaml`` runs it
as a second Serve application on its own route prefix, and the gateway's fallback client cannot
tell it from Gemini's OpenAI-compatible endpoint: it checks the bearer key when one is
configured, refuses the fields Gemini refuses, streams tool calls as Gemini does (no
``index``, the first call signed) and refuses a turn's unsigned calls as Gemini 3 does.
``GET /stats`` tells what its engine generated (what metering tests sum against).
``python -m serve_app.mock_openai --port N`` serves the same app without Ray: the "straight to
the backend" baseline of the overhead benchmark.
"""

from __future__ import annotations

import argparse
import hmac
import os
from collections.abc import Sequence
from typing import Any

import orjson
from ray import serve
from ray.serve import Application
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from serve_app import errors, protocol, sse
from serve_app.backends.gemini_compat import unsigned_steps
from serve_app.config.models import GEMINI_PARAMS, SimulatedEngineConfig
from serve_app.engines.base import Kind, Usage
from serve_app.engines.simulated import SimulatedEngine

_MODELS = {"chat": protocol.ChatCompletionRequest, "completion": protocol.CompletionRequest}


def create_mock_app(
    model: str,
    engine: dict,
    api_key: str | None = None,
    accepted_params: Sequence[str] | None = GEMINI_PARAMS,
) -> Starlette:
    """``accepted_params``: like Gemini, a field outside them is a 400, so a test catches a
    gateway that forwards what the real fallback would refuse."""
    simulated = SimulatedEngine(model, SimulatedEngineConfig.model_validate(engine), 256)
    simulated.stop_reason = False  # vLLM's extension: OpenAI's and Gemini's answers have none
    simulated.gemini_tool_calls = True  # unindexed deltas, signed calls (``gemini_compat.py``)
    expected_auth = f"Bearer {api_key}" if api_key else None

    async def models(request: Request) -> Response:
        listing = {"object": "list", "data": [{"id": model, "object": "model"}]}
        return Response(orjson.dumps(listing), media_type="application/json")

    async def serve_kind(request: Request, kind: Kind) -> Response:
        try:
            given = request.headers.get("authorization", "")
            if expected_auth and not hmac.compare_digest(given, expected_auth):
                raise errors.invalid_api_key()
            body, parsed = protocol.parse_request(await request.body(), _MODELS[kind])
            unknown = sorted(set(body) - set(accepted_params)) if accepted_params else []
            if unknown:
                raise errors.invalid_request(
                    f'Invalid JSON payload received. Unknown name "{unknown[0]}": Cannot find '
                    "field.",
                    param=unknown[0],
                )
            if parsed.model != model:
                raise errors.model_not_found(parsed.model)
            unsigned = unsigned_steps(body["messages"]) if kind == "chat" else []
            if unsigned:  # Gemini 3's check, in its words
                raise errors.invalid_request(
                    f"Function call in the {unsigned[0]}. content block is missing a "
                    "`thought_signature`.",
                    param="messages",
                )
            request_id = request.headers.get("x-request-id") or "mock"
            if not parsed.stream:
                response, _ = await simulated.complete(body, kind, request_id)
                return Response(orjson.dumps(response), media_type="application/json")
            return StreamingResponse(stream(body, kind, request_id), media_type="text/event-stream")
        except errors.ForgeError as err:
            return errors.error_response(err)

    async def stream(body: dict, kind: Kind, request_id: str):
        async for item in simulated.stream(body, kind, request_id):
            if not isinstance(item, Usage):
                yield item
        yield sse.DONE

    async def stats(request: Request) -> Response:
        """The engine's cumulative counters: what a test sums metering against."""
        return Response(orjson.dumps(simulated.stats().as_dict()), media_type="application/json")

    async def chat(request: Request) -> Response:
        return await serve_kind(request, "chat")

    async def completions(request: Request) -> Response:
        return await serve_kind(request, "completion")

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/stats", stats, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


@serve.ingress()
class MockOpenAI:
    def __init__(self, model: str, engine: dict, api_key_env: str | None = None) -> None:
        api_key = os.environ.get(api_key_env) if api_key_env else None
        self._app = create_mock_app(model, engine, api_key)

    def __serve_build_asgi_app__(self) -> Starlette:
        return self._app


def build_mock(args: dict[str, Any]) -> Application:
    deployment = serve.deployment(MockOpenAI).options(
        name="mock-openai", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024
    )
    return deployment.bind(
        args.get("model", "mock-gemini"), args.get("engine", {}), args.get("api_key_env")
    )


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Serve the mock OpenAI backend without Ray.")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--model", default="mock-gemini")
    parser.add_argument("--engine", default="{}", help="SimulatedEngineConfig as JSON")
    parser.add_argument(
        "--vllm-params",
        action="store_true",
        help="take vLLM's sampling extensions (ignore_eos, ...), as vLLM's server does, rather "
        "than refuse what Gemini refuses: outside benchmark clients send them",
    )
    args = parser.parse_args()
    accepted = None if args.vllm_params else GEMINI_PARAMS
    app = create_mock_app(args.model, orjson.loads(args.engine), accepted_params=accepted)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
