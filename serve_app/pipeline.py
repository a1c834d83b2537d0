"""The request pipeline: an ordered list of small stages, composed in one place.

A stage is ``async (ctx, call_next) -> Response``, like a Starlette middleware: it may act
before the rest of the pipeline, after it, or answer on its own (a 401, a 429, a cache hit).
The gateway lists the stages in the design's order; each stage is a module of ``stages/``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import Tracer
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from serve_app import errors, hop_delays
from serve_app.config.models import TenantConfig
from serve_app.engines.base import Kind
from serve_app.protocol import count_prompt_tokens

if TYPE_CHECKING:
    from serve_app.stages.cache_rules import StreamedAnswer
    from serve_app.traffic.policy import Target

logger = logging.getLogger("ray.serve")

Handler = Callable[["RequestContext"], Awaitable[Response]]

# How long a request may hold a lease or a slot when nothing says how long it may take (a pool's
# requests get their total deadline and some slack, ``stack.build_pipeline``): where the quota
# stage's lease renewer and admission's slot renewer stop.
MAX_REQUEST_LIFE_S = 3600.0


@dataclass(slots=True)
class RequestContext:
    """What one request carries through the stages; later stages read what earlier ones set."""

    request: Request
    route: Kind | str  # "chat", "completion", or a non-inference route such as "models"
    # The public API the client spoke, where it is not ``route`` itself ("responses",
    # "messages", "count_tokens"): what metrics and logs call the route.
    api: str | None = None
    dialect: str | None = None  # the dialect that translates it to ``route`` (``dialects/``)
    started: float = field(default_factory=time.perf_counter)
    request_id: str = ""  # the client's (or minted): headers, logs and spans only
    # Forge's own id for this request, never the client's: it keys everything inside (the
    # backend call, its pinned follow-ups, retry avoidance, abandoned usage), since clients'
    # ids repeat, across tenants too.
    key: str = field(default_factory=lambda: uuid.uuid4().hex)
    tenant: TenantConfig | None = None
    body: dict[str, Any] | None = None  # the client's JSON, forwarded to the backend
    parsed: Any = None  # the validated protocol model
    backend: str = "none"
    served_model: str | None = None  # the backend's model, when not the one asked (failover)
    replica: str | None = None
    usage: dict | None = None
    first_byte_at: float | None = None
    frames_sent: int = 0  # SSE frames relayed: the usage estimate when a stream is abandoned
    # The client left while a backend was answering and nothing said what that cost (an
    # external backend, which bills what it was sent; a replica that did not answer in time):
    # the tenant is charged the gateway's estimate, flagged, rather than nothing.
    left_uncounted: bool = False
    # Set by admission: gives the pool's slot back early (dispatch calls it on failover, when the
    # fallback, not the pool, is going to serve). Idempotent.
    release_slot: Callable[[], None] | None = None
    stream_error: str | None = None  # set when a stream ended with an SSE error event
    client_timeout_s: float | None = None  # the client's own total deadline, if it gave one
    # That deadline ended the request (``own_timeout``): the client's doing, counted as a 499.
    deadline_ran_out: bool = False
    cache: str | None = None  # "hit", "miss" or "bypass" once the cache stage has looked
    # What the cache keeps of a miss: the non-streamed answer, or the stream's, gathered from
    # its frames as relay passes them (set only when the cache wants it).
    completion: dict | None = None
    gathered: StreamedAnswer | None = None
    prompt_estimate: int | None = None  # the gateway's count of the prompt, once made
    model_served: bool = False  # set by parse: the body's model is one this gateway serves
    turn: Any = None  # the dialect's own state for this request, set as it translates the body
    # Where the model name leads (``traffic.policy.Target``), set by parse for a served model.
    target: Target | None = None
    adapter: str | None = None  # the LoRA adapter serving it (``serve_app/adapters.py``)
    # The first backend that failed the request or was routed around (its breaker open, or
    # scaled to zero): a variant's pool that could not serve it (``stages/telemetry.py``).
    first_failure: str | None = None

    @property
    def route_label(self) -> str:
        return self.api or str(self.route)

    @property
    def tenant_name(self) -> str:
        return self.tenant.name if self.tenant else "anonymous"

    @property
    def model_name(self) -> str:
        """The model asked for, once the body is validated ("none" before, or for listings)."""
        model = getattr(self.parsed, "model", None)
        return model if isinstance(model, str) else "none"

    @property
    def pool_model(self) -> str:
        """The model of the pool the request starts on (an alias's variant, or the step a
        chain spilled to): what quota's token default, the cache and admission key by."""
        target = self.target
        if target is not None and target.pool_model is not None:
            return target.pool_model
        return self.model_name

    def counted_prompt(self) -> int:
        """The gateway's count of the prompt, made once: quota, metering and a dialect's first
        event share it."""
        if self.prompt_estimate is None:
            self.prompt_estimate = count_prompt_tokens(self.body, self.route)
        return self.prompt_estimate

    def own_timeout(self, err: Exception) -> Exception:
        """A backend timeout that fired because the *client's* deadline ran out is the client's
        doing: a 504 that no breaker hears of (else one tenant sending ``x-request-timeout:
        0.001`` would open a pool's breakers for every tenant)."""
        deadline = self.client_timeout_s
        if (
            deadline is not None
            and getattr(err, "code", None) == "upstream_timeout"
            and time.perf_counter() - self.started >= deadline - 0.01
        ):
            self.deadline_ran_out = True
            return errors.client_deadline(deadline)
        return err

    @property
    def model_label(self) -> str:
        """The model as metrics, logs and usage records name it: a served model's name, else
        "unknown" (a client must not write text into Prometheus or mint a series per name)."""
        model = self.model_name
        return model if self.model_served or model == "none" else "unknown"


class Stage(Protocol):
    async def __call__(self, ctx: RequestContext, call_next: Handler) -> Response: ...


class EventStream(StreamingResponse):
    """An SSE response whose end is observed however it ends, even if its body never starts.

    Starlette sends the headers before it first reads the body; a client that leaves in between
    means the body generator never runs, so cleanup placed in it (release the slot, settle the
    quota, abort the generation) would never happen. Here it runs when the response itself is
    done, on every path; and if the response is never called at all (its request cancelled
    between the pipeline's return and the server's call), when it is collected.
    """

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        close_source: Callable[[], Awaitable[None]],
        headers: dict[str, str],
    ) -> None:
        super().__init__(self._relay(content), media_type="text/event-stream", headers=headers)
        self._close_source = close_source
        self._end_callbacks: list[Callable[[bool], None]] = []
        self._completed = False
        self._called = False

    async def _relay(self, content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        timed = hop_delays.DIR is not None
        try:
            async for chunk in content:
                yield chunk  # back here once the server has taken it
                if timed:
                    hop_delays.note(hop_delays.WRITTEN, chunk)
            self._completed = True
        finally:
            await content.aclose()

    def on_end(self, callback: Callable[[bool], None]) -> None:
        self._end_callbacks.append(callback)

    async def __call__(self, scope, receive, send) -> None:
        self._called = True
        try:
            await super().__call__(scope, receive, send)
        finally:
            # In a task of its own: a server that cancels the request when its client leaves
            # (Serve's proxy does) must not cut short the abort, the usage it reports, or the
            # settling and metering that follow it.
            await asyncio.shield(self._ending())

    def _ending(self) -> asyncio.Future:
        ending = asyncio.ensure_future(self._end())
        _ending.add(ending)
        ending.add_done_callback(_ending.discard)
        return ending

    def __del__(self) -> None:
        # Never called: nobody will read it. Its end runs all the same (the ending task holds
        # what it needs), or its slot, lease and renewers would outlive the request.
        if self._called or not (self._end_callbacks or self._close_source):
            return
        self._called = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # collected outside the loop (shutdown): nothing left to run on
            return
        self._ending()

    async def _end(self) -> None:
        try:
            # A generation nobody will read is aborted. ``close_source`` bounds its own waits
            # (the replica's count of an abandoned stream: ~2.5 s at most), so no timer here:
            # every stream would pay a task for it.
            await self._close_source()
        except Exception:
            logger.exception("closing a stream's source failed")
        finally:
            # However closing went (a cancellation included), the stages' end-of-response work
            # runs: the slot is released, the quota settled, the request metered.
            callbacks, self._end_callbacks = self._end_callbacks, []
            _run_all(callbacks, self._completed)


# Streams' endings still running after their request was cancelled (kept from the collector).
_ending: set[asyncio.Future] = set()


def final_status(ctx: RequestContext, response: Response, completed: bool) -> int:
    """The status an outcome is counted under: 499 when the client left first (nginx's
    "client closed request") or its own deadline ended it (it saw a 504, or an SSE error event
    with ``client_deadline_exceeded``: a choice of the client's, as leaving is, so neither the
    error ratio nor a backend's truncations count it), 599 for a stream that failed after its
    first byte (the client saw 200, then an SSE error event), else the response's own."""
    if not completed or ctx.deadline_ran_out:
        return 499
    if ctx.stream_error and isinstance(response, StreamingResponse):
        return 599
    return response.status_code


def error_status(ctx: RequestContext, err: errors.ForgeError) -> int:
    """What ``final_status`` counts a request under that failed with ``err``, seen before it
    became a response (metering's view)."""
    return 499 if ctx.deadline_ran_out else err.status


def on_response_end(response: Response, callback: Callable[[bool], None]) -> Response:
    """Call ``callback(completed)`` once the response has ended.

    For a stream that is when its last byte is sent, or when the client went away (``completed``
    False); for any other response it is now. ``callback`` must not block; async work it needs
    (a store round trip) it schedules itself.
    """
    if isinstance(response, EventStream):
        response.on_end(callback)
    elif isinstance(response, StreamingResponse):
        response.body_iterator = _observed(response.body_iterator, callback)
    else:
        callback(True)
    return response


async def _observed(body: AsyncIterator, callback: Callable[[bool], None]) -> AsyncIterator:
    completed = False
    try:
        async for chunk in body:
            yield chunk
        completed = True
    finally:
        _run_all([callback], completed)


def _run_all(callbacks: list[Callable[[bool], None]], completed: bool) -> None:
    """Every stage's end-of-response work runs, even if one of them fails."""
    for callback in callbacks:
        try:
            callback(completed)
        except Exception:
            logger.exception("end-of-response callback failed")


def compose(stages: Sequence[Stage], endpoint: Handler, tracer: Tracer | None = None) -> Handler:
    """Chain stages in order around the endpoint (the first stage runs first).

    With a ``tracer``, each stage gets a span from its entry until it hands the request on (or
    answers itself): its own cost, one after the other, so a slow admission wait or quota call
    shows as exactly that. Without one, nothing is added to the path.
    """
    handler = endpoint
    for stage in reversed(stages):
        handler = _bind(stage, handler) if tracer is None else _traced(stage, handler, tracer)
    return handler


def _bind(stage: Stage, call_next: Handler) -> Handler:
    async def handler(ctx: RequestContext) -> Response:
        return await stage(ctx, call_next)

    return handler


def traced_endpoint(endpoint: Handler, tracer: Tracer, name: str) -> Handler:
    """The endpoint in a span that is current while it runs (its backend calls are children)
    and ends with the response: for a stream, at its last byte."""

    async def handler(ctx: RequestContext) -> Response:
        span = tracer.start_span(name)
        try:
            # Exceptions are not recorded: their messages may quote the request (a tool name,
            # an upstream's words about the prompt); the span says only the error's type.
            with trace.use_span(
                span, end_on_exit=False, record_exception=False, set_status_on_exception=False
            ):
                response = await endpoint(ctx)
        except BaseException as exc:
            span.set_attribute("forge.error", type(exc).__name__)
            span.end()
            raise
        return on_response_end(response, lambda completed: span.end())

    return handler


def stage_name(stage: Stage) -> str:
    """``QuotaStage`` → ``quota``: the span's name, ``forge.<name>``."""
    return type(stage).__name__.removesuffix("Stage").lower()


def _traced(stage: Stage, call_next: Handler, tracer: Tracer) -> Handler:
    name = f"forge.{stage_name(stage)}"

    async def handler(ctx: RequestContext) -> Response:
        span = tracer.start_span(name)
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                span.end()

        async def handed_on(ctx: RequestContext) -> Response:
            end()
            return await call_next(ctx)

        try:
            return await stage(ctx, handed_on)
        except BaseException as exc:
            if not ended:
                span.set_attribute("forge.error", type(exc).__name__)
            raise
        finally:
            end()

    return handler
