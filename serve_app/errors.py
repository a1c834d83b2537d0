"""OpenAI-shaped errors: the one place that builds error bodies, responses and SSE error events.

Every failure a client can see is a ``ForgeError``; the ingress turns it into
``{"error": {"message", "type", "code", "param"}}`` with the right status. Nothing else formats
errors, so the shape cannot drift between the JSON and the streaming paths.
"""

from __future__ import annotations

import orjson
from starlette.responses import Response


class ForgeError(Exception):
    """A failure with the status, OpenAI error type and code a client should see."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }

    def __reduce__(self):
        # Replicas raise ForgeErrors that cross Ray's process boundary: pickle every field.
        return (
            _rebuild,
            (self.status, self.message, self.type, self.code, self.param, self.headers),
        )

    def __repr__(self) -> str:
        return f"ForgeError({self.status}, {self.code!r}, {self.message!r})"


def _rebuild(status, message, type, code, param, headers) -> ForgeError:
    return ForgeError(status, message, type=type, code=code, param=param, headers=headers)


def invalid_request(message: str, *, param: str | None = None, code: str = "invalid_value"):
    return ForgeError(400, message, type="invalid_request_error", code=code, param=param)


def invalid_api_key(message: str = "Invalid or missing API key.") -> ForgeError:
    # OpenAI answers 401 with type invalid_request_error and code invalid_api_key.
    return ForgeError(
        401,
        message,
        type="invalid_request_error",
        code="invalid_api_key",
        headers={"www-authenticate": "Bearer"},
    )


def model_not_found(model: str) -> ForgeError:
    return ForgeError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        type="invalid_request_error",
        code="model_not_found",
        param="model",
    )


def adapter_not_found(model: str, adapter: str) -> ForgeError:
    """``<model>:<adapter>`` where the model is served but has no such adapter (or not for
    this tenant): OpenAI's 404 for a model, naming the adapter asked for."""
    return ForgeError(
        404,
        f"The adapter `{adapter}` of model `{model}` does not exist or you do not have access "
        "to it.",
        type="invalid_request_error",
        code="model_not_found",
        param="model",
    )


def wrong_route(model: str, embeddings: bool) -> ForgeError:
    """A known model asked on a route it does not serve (a chat model's embeddings, or the
    reverse): the client's mistake, named, instead of a backend's confusion."""
    if embeddings:
        message = f"The model `{model}` does not serve embeddings: it is a generation model."
    else:
        message = f"The model `{model}` is an embedding model: send its requests to /v1/embeddings."
    return ForgeError(
        400, message, type="invalid_request_error", code="unsupported_model", param="model"
    )


def context_length_exceeded(model: str, needed: int, largest: int) -> ForgeError:
    """OpenAI's and vLLM's code for a request longer than the model takes."""
    return invalid_request(
        f"This request needs {needed} tokens (prompt and completion); the longest model '{model}' "
        f"can route to takes {largest}. Shorten the messages or lower max_tokens.",
        param="messages",
        code="context_length_exceeded",
    )


def unsupported_route(model: str, kind: str) -> ForgeError:
    """A model whose only backend does not serve this kind of request (an upstream without
    /v1/completions): named, instead of the upstream's bare 404."""
    path = {
        "chat": "/v1/chat/completions",
        "completion": "/v1/completions",
        "embedding": "/v1/embeddings",
    }.get(kind, kind)
    return ForgeError(
        400,
        f"The model `{model}` is not served on {path}.",
        type="invalid_request_error",
        code="unsupported_model",
        param="model",
    )


def not_found(path: str) -> ForgeError:
    return ForgeError(404, f"No route for {path}.", type="invalid_request_error", code="not_found")


def method_not_allowed(method: str, path: str) -> ForgeError:
    return ForgeError(
        405,
        f"{method} is not allowed on {path}.",
        type="invalid_request_error",
        code="method_not_allowed",
    )


def payload_too_large(limit: int) -> ForgeError:
    return ForgeError(
        413,
        f"Request body is larger than the {limit} bytes this gateway accepts.",
        type="invalid_request_error",
        code="request_too_large",
    )


def headers_too_large(limit: int) -> ForgeError:
    return ForgeError(
        431,
        f"Request headers are larger than the {limit} bytes this gateway accepts.",
        type="invalid_request_error",
        code="request_headers_too_large",
    )


def body_timeout(seconds: float) -> ForgeError:
    return ForgeError(
        408,
        f"The request body did not arrive within {seconds:g} s.",
        type="invalid_request_error",
        code="request_timeout",
    )


def admin_key_required() -> ForgeError:
    return ForgeError(
        403,
        "This route needs an admin key; a tenant's API key cannot use it.",
        type="permission_error",
        code="admin_key_required",
    )


def tenant_key_required() -> ForgeError:
    return ForgeError(
        403,
        "/v1/usage reports the calling tenant's usage, and an admin key has no tenant: "
        "use /admin/usage (with ?tenant=NAME for one tenant).",
        type="permission_error",
        code="tenant_key_required",
    )


def tenant_not_found(name: str) -> ForgeError:
    return ForgeError(
        404,
        f"No tenant named {name!r}.",
        type="invalid_request_error",
        code="tenant_not_found",
        param="tenant",
    )


def unavailable(what: str, code: str) -> ForgeError:
    """An admin route's dependency (the usage store, the breaker board) did not answer."""
    return ForgeError(
        503,
        f"{what} unavailable; try again shortly.",
        type="api_error",
        code=code,
        headers={"retry-after": "1"},
    )


def rate_limited(message: str, *, kind: str, headers: dict[str, str]) -> ForgeError:
    # OpenAI's 429s name the exhausted limit in ``type`` ("requests", "tokens").
    return ForgeError(429, message, type=kind, code="rate_limit_exceeded", headers=headers)


def bad_gateway(message: str = "The model backend failed to answer.") -> ForgeError:
    return ForgeError(502, message, type="api_error", code="bad_gateway")


def backend_unavailable(message: str = "No model backend is available.") -> ForgeError:
    return ForgeError(
        503, message, type="api_error", code="backend_unavailable", headers={"retry-after": "1"}
    )


def at_capacity(message: str, retry_after_s: float = 1.0) -> ForgeError:
    """Busy, not broken: failed over like a failure, never counted against a breaker."""
    return ForgeError(
        503,
        message,
        type="api_error",
        code="backend_at_capacity",
        headers={"retry-after": str(max(1, round(retry_after_s)))},
    )


def upstream_timeout(message: str = "The model backend timed out.") -> ForgeError:
    return ForgeError(504, message, type="api_error", code="upstream_timeout")


def client_closed() -> ForgeError:
    """The client left before its request was read (nginx's 499): nobody sees the answer; it
    is counted as a disconnect, never as a server error."""
    return ForgeError(
        499, "The client closed the request.", type="invalid_request_error", code="client_closed"
    )


def client_deadline(seconds: float) -> ForgeError:
    """The client's own deadline (``x-request-timeout``) ran out: a 504, but not the backend's
    failure, so no breaker hears of it."""
    return ForgeError(
        504,
        f"The request did not finish within the client's own deadline ({seconds:g} s).",
        type="api_error",
        code="client_deadline_exceeded",
    )


def internal_error() -> ForgeError:
    # Deliberately vague: details go to the log with the request id, never to the client.
    return ForgeError(500, "Internal gateway error.", type="api_error", code="internal_error")


def error_response(err: ForgeError, headers: dict[str, str] | None = None) -> Response:
    merged = {**err.headers, **(headers or {})}
    return Response(
        orjson.dumps(err.body()),
        status_code=err.status,
        headers=merged,
        media_type="application/json",
    )


def error_event(err: ForgeError) -> bytes:
    """The SSE event that ends a stream honestly when it fails after the first byte."""
    return b"data: " + orjson.dumps(err.body()) + b"\n\n"


# A replica's refusal of a request travels back as an item, not as a raised error: Serve writes
# a raised error's message (which quotes the request: a tool's name, a field) to the replica's
# log. The gateway raises it again (``raise_if_refused``).
_REFUSED = "refused"


def refusal_item(err: ForgeError) -> dict:
    return {
        _REFUSED: {
            "status": err.status,
            "message": err.message,
            "type": err.type,
            "code": err.code,
            "param": err.param,
            "headers": err.headers,
        }
    }


def raise_if_refused(item: object) -> None:
    """Raise the refusal ``item`` carries, if it is one."""
    if isinstance(item, dict) and _REFUSED in item:
        r = item[_REFUSED]
        raise ForgeError(
            r["status"],
            r["message"],
            type=r["type"],
            code=r["code"],
            param=r["param"],
            headers=r["headers"],
        )
