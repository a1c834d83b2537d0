"""Read the body under its limits (size, time) and validate it: 413, 408 and 400 are decided
here, before quota or admission spend anything on the request."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

from starlette.requests import ClientDisconnect
from starlette.responses import Response

from serve_app import errors, protocol
from serve_app.config.models import GatewayConfig
from serve_app.dialects.base import Dialect
from serve_app.pipeline import Handler, RequestContext
from serve_app.protocol import count_prompt_tokens
from serve_app.traffic.policy import VARIANT_HEADER, TrafficPolicy, place

_MODELS = {
    "chat": protocol.ChatCompletionRequest,
    "completion": protocol.CompletionRequest,
    "embedding": protocol.EmbeddingRequest,
}
# A client's own deadline, in seconds: ours, then the one the OpenAI SDKs send with every call.
_TIMEOUT_HEADERS = ("x-request-timeout", "x-stainless-timeout")


class ParseStage:
    def __init__(
        self,
        limits: GatewayConfig,
        policy: TrafficPolicy | None = None,
        dialects: Mapping[str, Dialect] | None = None,
    ) -> None:
        self.max_body_bytes = limits.max_body_bytes
        self.max_messages = limits.max_messages
        self.body_timeout_s = limits.body_timeout_s
        self.policy = policy  # served names, what each does, and where each leads
        self.tasks = policy.tasks if policy is not None else {}  # name → "generate" or "embed"
        self.dialects = dict(dialects or {})  # name → the API it translates to chat

    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response:
        try:
            async with asyncio.timeout(self.body_timeout_s):  # no task per request, unlike wait_for
                raw = await self._read(ctx)
        except TimeoutError:
            raise errors.body_timeout(self.body_timeout_s) from None
        except ClientDisconnect:
            raise errors.client_closed() from None
        if ctx.dialect is None:
            ctx.body, ctx.parsed = protocol.parse_request(raw, _MODELS[ctx.route])
        else:  # the client's API, as the chat body every later stage and backend reads
            body = await self.dialects[ctx.dialect].to_chat(protocol.load_object(raw), ctx)
            ctx.body, ctx.parsed = body, protocol.validate(body, _MODELS[ctx.route])
        messages = getattr(ctx.parsed, "messages", None)
        if messages is not None and len(messages) > self.max_messages:
            raise errors.invalid_request(
                f"This request has {len(messages)} messages; this gateway accepts at most "
                f"{self.max_messages}.",
                param="messages",
                code="too_many_messages",
            )
        model = ctx.parsed.model
        task = self.tasks.get(model)  # unknown models are dispatch's 404
        allowed = ctx.tenant.models if ctx.tenant is not None else None
        if task is not None and allowed is not None and model not in allowed:
            raise errors.model_not_found(model)  # told as if it did not exist
        ctx.model_served = task is not None
        if task is not None and (task == "embed") != (ctx.route == "embedding"):
            raise errors.wrong_route(model, embeddings=ctx.route == "embedding")
        ctx.client_timeout_s = _client_timeout(ctx)
        if task is None or self.policy is None:
            return await call_next(ctx)
        target = self.policy.resolve(model, ctx.tenant_name, ctx.body, ctx.request.headers)
        if target.variant is None:  # a pool's own name: where it always went
            ctx.target = target
            return await call_next(ctx)
        try:
            prompt = ctx.prompt_estimate = count_prompt_tokens(ctx.body, ctx.route)
            ctx.target = place(target, prompt, ctx.parsed.output_limit())
            response = await call_next(ctx)
        except errors.ForgeError as err:  # the variant's own errors say which it was
            err.headers[VARIANT_HEADER] = target.variant
            raise
        response.headers[VARIANT_HEADER] = target.variant
        return response

    async def _read(self, ctx: RequestContext) -> bytes:
        limit = self.max_body_bytes
        declared = ctx.request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise errors.payload_too_large(limit)
        chunks, size = [], 0
        async for chunk in ctx.request.stream():  # also bounds chunked bodies
            size += len(chunk)
            if size > limit:
                raise errors.payload_too_large(limit)
            chunks.append(chunk)
        return b"".join(chunks)


def _client_timeout(ctx: RequestContext) -> float | None:
    """Checked here, before quota and admission spend anything on a request that is malformed."""
    headers = ctx.request.headers
    for name in _TIMEOUT_HEADERS:
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value)
        except ValueError:
            if name == "x-request-timeout":
                raise errors.invalid_request(
                    "x-request-timeout must be a number of seconds.", param=name
                ) from None
            continue  # the SDK's header is advisory; a strange one is ignored
        if seconds > 0 and math.isfinite(seconds):
            return seconds
    return None
