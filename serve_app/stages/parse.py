"""Read the body under its limits (size, time) and validate it: 413, 408 and 400 are decided
here, before quota or admission spend anything on the request."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping

from starlette.requests import ClientDisconnect
from starlette.responses import Response

from serve_app import errors, protocol
from serve_app.adapters import ADAPTER_KEY, split_adapter_model
from serve_app.config.models import GatewayConfig
from serve_app.dialects.base import Dialect
from serve_app.engines.truncation import TRUNCATE_KEY
from serve_app.pipeline import Handler, RequestContext
from serve_app.traffic.policy import VARIANT_HEADER, Target, TrafficPolicy, place

_MODELS = {
    "chat": protocol.ChatCompletionRequest,
    "completion": protocol.CompletionRequest,
    "embedding": protocol.EmbeddingRequest,
}
# A client's own deadline, in seconds: ours, a total deadline; else the SDKs' timeout (the OpenAI
# Node SDK's on every call; the Anthropic SDKs' where a call sets one: ``_client_timeout``).
_SDK_TIMEOUT = "x-stainless-timeout"
_TIMEOUT_HEADERS = ("x-request-timeout", _SDK_TIMEOUT)


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
        # Chat's messages, validated as a list; another route's ``messages`` is a stray field
        # (its models let extra fields through to the engine), never counted here.
        messages = ctx.parsed.messages if ctx.route == "chat" else None
        if messages is not None and len(messages) > self.max_messages:
            raise errors.invalid_request(
                f"This request has {len(messages)} messages; this gateway accepts at most "
                f"{self.max_messages}.",
                param="messages",
                code="too_many_messages",
            )
        model = ctx.parsed.model
        ctx.body.pop(ADAPTER_KEY, None)  # only the gateway says which adapter serves it
        if ctx.dialect is None:  # and which conversation is truncated (``engines/truncation``)
            ctx.body.pop(TRUNCATE_KEY, None)
        task = self.tasks.get(model)  # unknown models are dispatch's 404
        if task is None:
            self._unknown_adapter(ctx, model)
        if task is not None and not self._may_call(ctx, model):
            raise errors.model_not_found(model)  # told as if it did not exist
        ctx.model_served = task is not None
        if task is not None and (task == "embed") != (ctx.route == "embedding"):
            raise errors.wrong_route(model, embeddings=ctx.route == "embedding")
        ctx.client_timeout_s = _client_timeout(ctx)
        if task is None or self.policy is None:
            return await call_next(ctx)
        target = self.policy.resolve(model, ctx.tenant_name, ctx.body, ctx.request.headers)
        if ctx.dialect == "messages":
            _fit_output(ctx, self.policy.window(target.steps))
        if target.variant is None:  # a pool's own name: where it always went
            ctx.target = self._with_adapter(ctx, target)
            return await call_next(ctx)
        try:
            target = self._placed(ctx, target)
            ctx.target = self._with_adapter(ctx, target)
            response = await call_next(ctx)
        except errors.ForgeError as err:  # the variant's own errors say which it was
            err.headers[VARIANT_HEADER] = target.variant
            raise
        response.headers[VARIANT_HEADER] = target.variant
        return response

    def _placed(self, ctx: RequestContext, target: Target) -> Target:
        """``target`` placed on the step its length starts on (``traffic.policy.place``); a
        request too long for every step of its variant goes to another variant that takes
        it, and only where none does is it the 400, naming the longest window of them all."""
        assert self.policy is not None
        prompt, output = ctx.counted_prompt(), ctx.parsed.output_limit()
        truncated = TRUNCATE_KEY in ctx.body
        try:
            return place(target, prompt, output, truncated=truncated)
        except errors.ForgeError as err:
            if err.code != "context_length_exceeded":
                raise
            refused = err
        others = self.policy.other_variants(target)
        for other in others:
            try:
                return place(other, prompt, output, truncated=truncated)
            except errors.ForgeError as err:
                if err.code != "context_length_exceeded":
                    raise
        windows = [s.context or 0 for t in (target, *others) for s in t.steps]
        needed = prompt + (output or target.steps[0].default_max_tokens)
        if max(windows, default=0) > 0:
            raise errors.context_length_exceeded(target.model, needed, max(windows)) from None
        raise refused

    def _may_call(self, ctx: RequestContext, model: str) -> bool:
        if self.policy is not None:
            return self.policy.may_call(ctx.tenant, model)
        allowed = ctx.tenant.models if ctx.tenant is not None else None
        return allowed is None or model in allowed

    def _unknown_adapter(self, ctx: RequestContext, model: str) -> None:
        """``<model>:<adapter>`` of a model this tenant may call, with no such adapter: a 404
        that names the adapter (any other unknown name is dispatch's plain 404)."""
        base, adapter = split_adapter_model(model)
        if adapter is None or base not in self.tasks or self.policy is None:
            return
        if self.policy.may_call(ctx.tenant, base):
            raise errors.adapter_not_found(base, adapter)

    def _with_adapter(self, ctx: RequestContext, target: Target) -> Target:
        """The adapter this request gets (``TrafficPolicy.bind``), told to the pool's router
        and replica in the body."""
        target = self.policy.bind(target, ctx.tenant)
        if target.adapter is not None:
            ctx.adapter = target.adapter
            ctx.body[ADAPTER_KEY] = target.adapter
        return target

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


def _fit_output(ctx: RequestContext, room: int | None) -> None:
    """An Anthropic client's ``max_tokens`` cut to ``room``, the smallest context window of the
    pools the request may land on. Anthropic's clients size it for Claude (Claude Code asks for
    32,000 tokens and more), which a self-hosted model's window may not hold: vLLM refuses a
    ``max_tokens`` past its whole window, and the quota stage would reserve it. Past what the
    prompt leaves of the window, vLLM cuts it itself, with the model's own count of the
    prompt (the gateway's is an estimate: cutting by it could leave too little). Left as it is
    where a pool's window is not in its config."""
    limit = ctx.parsed.output_limit()
    if room is not None and limit is not None and limit > room:
        ctx.body["max_tokens"] = ctx.parsed.max_tokens = room
        ctx.body.pop("max_completion_tokens", None)
        ctx.parsed.max_completion_tokens = None


def _client_timeout(ctx: RequestContext) -> float | None:
    """Checked here, before quota and admission spend anything on a request that is malformed.

    The SDKs' header is a deadline for a non-streamed request only, whose answer comes whole.
    For a stream it times the wait for the response's headers (the Node SDK) or between two
    chunks (the Anthropic SDK, httpx's read timeout), never the whole stream: taken as a total
    deadline, it cut a coding agent's long answer, streamed steadily, at the SDK's timeout. The
    SDK keeps that timeout itself, by leaving (a 499, charged what the engine spent)."""
    headers = ctx.request.headers
    streamed = bool(getattr(ctx.parsed, "stream", False))
    for name in _TIMEOUT_HEADERS:
        value = headers.get(name)
        if value is None or (streamed and name == _SDK_TIMEOUT):
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
