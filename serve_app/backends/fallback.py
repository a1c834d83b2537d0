"""The external fallback: any OpenAI-compatible HTTP endpoint (Gemini in production).

Frames are passed through as they arrive; only the framing is parsed, and the one frame that
carries ``usage`` (which we always ask upstream for, to meter) is decoded, as is a frame with
tool calls that lack their ``index`` (Gemini's; ``gemini_compat.py``). The Authorization
header comes from ``credentials`` on every request, since a workload-identity token expires.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import orjson

from serve_app import errors, sse
from serve_app.backends.base import paced
from serve_app.backends.credentials import Credentials, credentials_for
from serve_app.backends.gemini_compat import ToolCallIndexes, signed
from serve_app.config.models import FallbackConfig
from serve_app.engines.base import Kind
from serve_app.engines.truncation import TRUNCATE_KEY
from serve_app.protocol import REASONING_FIELDS
from serve_app.tracing import carrier

_PATHS = {"chat": "chat/completions", "completion": "completions"}


class FallbackBackend:
    name = "fallback"
    pool = None  # an external endpoint: no replicas to count, wake or avoid

    def __init__(
        self,
        config: FallbackConfig,
        transport: httpx.AsyncBaseTransport | None = None,
        credentials: Credentials | None = None,
    ):
        self.config = config
        self.served_model = config.model
        self.kinds = config.kinds
        # Built here, at start: a missing API key secret stops the deployment.
        self._credentials = credentials if credentials is not None else credentials_for(config)
        self._client = httpx.AsyncClient(
            base_url=config.base_url.rstrip("/") + "/",
            headers={"content-type": "application/json"},
            timeout=httpx.Timeout(
                connect=config.connect_timeout_s,
                read=config.read_timeout_s,
                write=config.connect_timeout_s,
                pool=config.connect_timeout_s,
            ),
            limits=httpx.Limits(
                max_connections=config.max_connections,
                max_keepalive_connections=config.max_connections,
            ),
            transport=transport,
        )

    def _upstream_body(self, body: dict, stream: bool) -> bytes:
        accepted = self.config.accepted_params
        if accepted is not None:
            body = {k: v for k, v in body.items() if k in accepted}
        upstream = {**body, "model": self.config.model, "stream": stream}
        upstream.pop(TRUNCATE_KEY, None)  # the gateway's word to its replicas, for no one else
        if isinstance(body.get("messages"), list):
            upstream["messages"] = messages = _without_reasoning(body["messages"])
            if self.config.fill_thought_signatures:
                upstream["messages"] = signed(messages)
        if stream:
            upstream["stream_options"] = {
                **(body.get("stream_options") or {}),
                "include_usage": True,
            }
        return orjson.dumps(upstream)

    async def stream(
        self, body: dict, kind: Kind, request_id: str, budget_s: float | None = None
    ) -> AsyncIterator[list]:
        wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        request = self._client.build_request(
            "POST",
            _PATHS[kind],
            content=self._upstream_body(body, stream=True),
            headers=await self._headers(request_id),
        )
        deadline = self._deadline(budget_s)
        response = await self._send(request, stream=True, deadline=deadline)
        try:
            if response.status_code >= 400:
                raise _upstream_error(response.status_code, await response.aread(), request)
            frames = sse.split_frames(response.aiter_raw())
            c = self.config
            paced_frames = paced(
                frames, c.first_token_timeout_s, c.read_timeout_s, deadline, "The fallback model"
            )
            indexes = ToolCallIndexes()
            async for events in paced_frames:
                batch: list = []
                for event in events:
                    event = indexes.mend(event)
                    if sse.frame_data(event) == b"[DONE]":
                        continue  # the gateway sends its own [DONE]
                    if _may_carry_usage(event):
                        usage_frame = _decode(event)
                        if usage_frame.get("usage"):
                            batch.append({"usage": usage_frame["usage"]})
                            if not wants_usage and not usage_frame.get("choices"):
                                continue  # a usage-only frame the client did not ask for
                    batch.append(event)
                if batch:
                    yield batch
        except httpx.TimeoutException as exc:
            raise errors.upstream_timeout("The fallback model stopped answering.") from exc
        except httpx.HTTPError as exc:
            raise errors.bad_gateway(f"The fallback stream broke: {type(exc).__name__}.") from exc
        except sse.FrameTooLarge as exc:  # never buffered whole: cut, and said so
            raise errors.bad_gateway(f"The fallback model's stream broke: {exc}.") from exc
        finally:
            await response.aclose()

    async def complete(
        self, body: dict, kind: Kind, request_id: str, budget_s: float | None = None
    ) -> dict:
        request = self._client.build_request(
            "POST",
            _PATHS[kind],
            content=self._upstream_body(body, stream=False),
            headers=await self._headers(request_id),
        )
        response = await self._send(request, stream=False, deadline=self._deadline(budget_s))
        if response.status_code >= 400:
            raise _upstream_error(response.status_code, response.content, request)
        try:
            return {"response": orjson.loads(response.content), "replica": None}
        except orjson.JSONDecodeError:
            raise errors.bad_gateway("The fallback model answered with invalid JSON.") from None

    async def _headers(self, request_id: str) -> dict[str, str]:
        """The request id and the trace context (``traceparent``) travel upstream; the
        credentials are fetched per request, since a workload-identity token expires."""
        return {
            "x-request-id": request_id,
            **(carrier() or {}),
            **await self._credentials.headers(),
        }

    def _deadline(self, budget_s: float | None) -> float:
        total = self.config.request_timeout_s
        return asyncio.get_running_loop().time() + min(total, budget_s or total)

    async def _send(
        self, request: httpx.Request, *, stream: bool, deadline: float
    ) -> httpx.Response:
        """Send; a non-streaming answer must be complete, and a stream's headers in, by the
        deadline (httpx's own timeouts bound each connect and read within it)."""
        timeout = max(deadline - asyncio.get_running_loop().time(), 0)
        try:
            return await asyncio.wait_for(self._client.send(request, stream=stream), timeout)
        except TimeoutError:
            raise errors.upstream_timeout("The fallback model did not answer in time.") from None
        except httpx.TimeoutException as exc:
            raise errors.upstream_timeout("The fallback model timed out.") from exc
        except httpx.HTTPError as exc:
            raise errors.bad_gateway(
                f"The fallback model is unreachable: {type(exc).__name__}."
            ) from exc

    async def ready(self) -> bool:
        """Credentials available and, when there is a ``health_path``, upstream answering it.
        Failed checks count against the fallback's breaker, so an upstream with nothing to GET
        is checked by its credentials alone rather than failing a probe it cannot pass."""
        try:
            headers = await self._credentials.headers()
            if self.config.health_path is None:
                return True
            response = await self._client.get(self.config.health_path, headers=headers, timeout=2.0)
        except (httpx.HTTPError, errors.ForgeError):
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        await self._client.aclose()
        await self._credentials.aclose()


def _may_carry_usage(event: bytes) -> bool:
    """Cheap pre-check so only the frame with real usage is decoded, not every chunk."""
    return b'"usage"' in event and b'"usage":null' not in event and b'"usage": null' not in event


def _decode(event: bytes) -> dict:
    try:
        return orjson.loads(sse.frame_data(event))
    except orjson.JSONDecodeError:
        raise errors.bad_gateway("The fallback model sent a malformed event.") from None


def _upstream_error(
    status: int, content: bytes, request: httpx.Request | None = None
) -> errors.ForgeError:
    """Upstream's 4xx about the request are the client's: pass their message on, with Forge's
    credentials cut out of it (an upstream may quote the headers it got). Its 5xx, and 4xx about
    *us* (our credentials, our quota with the provider), are a failing backend."""
    if status in (401, 403):
        return errors.bad_gateway(
            f"The fallback model refused Forge's credentials (HTTP {status})."
        )
    if status == 429:
        return errors.at_capacity("The fallback model is rate limiting Forge.")
    if status >= 500:
        return errors.bad_gateway(f"The fallback model failed with HTTP {status}.")
    message, type_, code = f"The fallback model rejected the request (HTTP {status}).", None, None
    try:
        detail = orjson.loads(content)["error"]
        message = detail.get("message") or message
        type_, code = detail.get("type"), detail.get("code")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        pass
    return errors.ForgeError(
        status, _redacted(str(message), request), type=type_ or "invalid_request_error", code=code
    )


def _redacted(text: str, request: httpx.Request | None) -> str:
    """``text`` without the credential Forge sent (the header's value, and its token alone)."""
    if request is None:
        return text
    for name in ("authorization", "x-goog-api-key", "api-key"):
        value = request.headers.get(name)
        if not value:
            continue
        for secret in {value, value.partition(" ")[2].strip()} - {""}:
            text = text.replace(secret, "[redacted]")
    return text


def _without_reasoning(messages: list) -> list:
    """The conversation without the primary model's reasoning: another model's thoughts are no
    prompt for the fallback, and an API may refuse the field (DeepSeek's refuses
    ``reasoning_content`` in a request)."""
    return [
        {k: v for k, v in m.items() if k not in REASONING_FIELDS}
        if isinstance(m, dict) and any(k in m for k in REASONING_FIELDS)
        else m
        for m in messages
    ]
