"""The gateway's OpenAPI schema: FastAPI renders the usage and admin routes; the inference
routes, which are plain Starlette routes, are added here from the wire types themselves
(``serve_app/protocol.py``), so the schema describes exactly what the gateway validates."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from serve_app.dialects.messages import CountTokensRequest, MessagesRequest
from serve_app.dialects.responses import ResponsesRequest
from serve_app.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

SCHEMA_REF = "#/components/schemas/{model}"
BEARER = "bearer"  # the security scheme's name in the schema
KEY_HEADER = "x-api-key"  # Anthropic's header, taken on every route as the same key


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    """Every error the gateway answers, as OpenAI shapes it."""

    error: ErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Every error of the Messages routes, as Anthropic shapes it."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
    request_id: str | None = None


class TokenCount(BaseModel):
    input_tokens: int


class InputTokens(BaseModel):
    object: Literal["response.input_tokens"] = "response.input_tokens"
    input_tokens: int


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool


class ModelCard(BaseModel):
    """OpenAI's model object with vLLM's fields. To a client that sends ``anthropic-version``,
    Anthropic's instead (``type``, ``display_name``, ``max_input_tokens``; a list is paged by
    ``limit``, ``after_id`` and ``before_id``)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int | None = None  # the smallest context window of the pools it may use
    parent: str | None = None  # an adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    backends: dict[str, bool]


def with_inference_routes(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's schema of the admin routes, plus the Starlette inference routes (request bodies
    from the wire types themselves, so the schema cannot drift from what is validated), and
    400s in place of the 422s FastAPI documents but this gateway never answers."""
    components = schema.setdefault("components", {})
    models = components.setdefault("schemas", {})
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", _error_ref("Invalid request"))
    for unused in ("HTTPValidationError", "ValidationError"):
        models.pop(unused, None)
    for model in (
        ErrorResponse,
        ModelList,
        Health,
        Readiness,
        AnthropicError,
        TokenCount,
        InputTokens,
        ResponseDeleted,
    ):
        add_component(models, model, mode="serialization")
    schemes = components.setdefault("securitySchemes", {})
    schemes[BEARER] = {
        "type": "http",
        "scheme": "bearer",
        "description": "A tenant's API key (inference, /v1/usage) or an admin key (/admin/*).",
    }
    schemes[KEY_HEADER] = {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "A tenant's API key, as Anthropic's SDK sends it (any inference route).",
    }
    security = [{BEARER: []}, {KEY_HEADER: []}]
    failures = {
        "400": _error_ref("Invalid request: the message names the parameter"),
        "401": _error_ref("Missing, malformed or unknown API key"),
        "404": _error_ref("Unknown model"),
        "413": _error_ref("Request body too large"),
        "429": _error_ref("Over a rate limit, or the tenant's queue is full (see Retry-After)"),
        "502": _error_ref("The backend failed"),
        "503": _error_ref("No backend available"),
        "504": _error_ref("The backend timed out"),
    }
    paths: dict[str, Any] = {}
    streamed = "with stream: true an SSE stream of {kind} chunks ending with data: [DONE]"
    events = "with stream: true an SSE stream of {kind} events (event: and data: lines)"
    anthropic_failures = {
        status: {
            "description": f["description"],
            "content": _json_ref("", AnthropicError)["content"],
        }
        for status, f in failures.items()
    }
    for path, model, kind, description, errors in (
        ("/v1/chat/completions", ChatCompletionRequest, "chat.completion", streamed, failures),
        ("/v1/completions", CompletionRequest, "text_completion", streamed, failures),
        ("/v1/embeddings", EmbeddingRequest, "embedding list", None, failures),
        ("/v1/responses", ResponsesRequest, "response", events, failures),
        ("/v1/messages", MessagesRequest, "message", events, anthropic_failures),
    ):
        content: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
        summary = f"A {kind} object"
        if description is not None:
            # One server-sent event, as OpenAPI 3.1 readers take a stream's schema: its data
            # line is a JSON chunk, or [DONE] at the end.
            content["text/event-stream"] = {
                "schema": {
                    "type": "object",
                    "required": ["data"],
                    "properties": {"data": {"type": "string"}},
                }
            }
            summary += ", or " + description.format(kind=kind)
        paths[path] = {
            "post": {
                "tags": ["inference"],
                "summary": f"Create a{'n' if kind[0] in 'aeiou' else ''} {kind}",
                "operationId": f"create_{kind.replace('.', '_').replace(' ', '_')}",
                "security": security,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": add_component(models, model)}},
                },
                "responses": {"200": {"description": summary, "content": content}, **errors},
            }
        }
    paths["/v1/messages/count_tokens"] = {
        "post": {
            "tags": ["inference"],
            "summary": "Count a message's input tokens (the gateway's count, as budgets use)",
            "operationId": "count_message_tokens",
            "security": security,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": add_component(models, CountTokensRequest)}
                },
            },
            "responses": {
                "200": _json_ref("The input tokens", TokenCount),
                **{k: anthropic_failures[k] for k in ("400", "401", "404", "413")},
            },
        }
    }
    paths["/v1/responses/input_tokens"] = {
        "post": {
            "tags": ["inference"],
            "summary": "Count a response's input tokens (the gateway's count, as budgets use)",
            "operationId": "count_response_input_tokens",
            "security": security,
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": add_component(models, ResponsesRequest)}
                },
            },
            "responses": {
                "200": _json_ref("The input tokens", InputTokens),
                **{k: failures[k] for k in ("400", "401", "404", "413")},
            },
        }
    }
    stored = {
        "name": "response_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
    }
    paths["/v1/responses/{response_id}"] = {
        "get": {
            "tags": ["inference"],
            "summary": "A stored response of the calling tenant",
            "operationId": "get_response",
            "security": security,
            "parameters": [stored],
            "responses": {
                "200": {
                    "description": "The response object",
                    "content": {"application/json": {"schema": {"type": "object"}}},
                },
                "401": failures["401"],
                "404": _error_ref("No such response for this tenant"),
                "503": _error_ref("The store did not answer"),
            },
        },
        "delete": {
            "tags": ["inference"],
            "summary": "Delete a stored response of the calling tenant",
            "operationId": "delete_response",
            "security": security,
            "parameters": [stored],
            "responses": {
                "200": _json_ref("Deleted", ResponseDeleted),
                "401": failures["401"],
                "404": _error_ref("No such response for this tenant"),
                "503": _error_ref("The store did not answer"),
            },
        },
    }
    paths["/v1/models"] = {
        "get": {
            "tags": ["inference"],
            "summary": "List the served models",
            "operationId": "list_models",
            "security": security,
            "responses": {
                "200": _json_ref("The served models", ModelList),
                "401": failures["401"],
            },
        }
    }
    paths["/v1/models/{model}"] = {
        "get": {
            "tags": ["inference"],
            "summary": "One model the calling tenant may call",
            "operationId": "retrieve_model",
            "security": security,
            "parameters": [
                {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "responses": {
                "200": _json_ref("The model", ModelCard),
                "401": failures["401"],
                "404": _error_ref("No such model for this tenant"),
            },
        }
    }
    paths["/healthz"] = {
        "get": {
            "tags": ["health"],
            "summary": "Liveness: the gateway answers",
            "operationId": "healthz",
            "security": [],
            "responses": {"200": _json_ref("Alive", Health)},
        }
    }
    paths["/readyz"] = {
        "get": {
            "tags": ["health"],
            "summary": "Readiness: some backend can serve",
            "operationId": "readyz",
            "security": [],
            "responses": {
                "200": _json_ref("Ready", Readiness),
                "503": _json_ref("No backend can serve", Readiness),
            },
        }
    }
    schema["paths"] = {**paths, **schema.get("paths", {})}  # inference first, as served
    return schema


def add_component(
    components: dict[str, Any], model: type[BaseModel], *, mode: JsonSchemaMode = "validation"
) -> dict[str, str]:
    """Put a model's JSON schema and its ``$defs`` among the components; a ``$ref`` to it.

    A request body's schema must be the model's own (a name taken by another schema is an
    error); a response model FastAPI already rendered for the admin routes is kept as rendered.
    """
    schema = model.model_json_schema(ref_template=SCHEMA_REF, mode=mode)
    for name, sub in {**schema.pop("$defs", {}), model.__name__: schema}.items():
        kept = components.setdefault(name, sub)
        if mode == "validation" and kept != sub:
            raise ValueError(f"two different schemas are both named {name!r}")
    return {"$ref": SCHEMA_REF.format(model=model.__name__)}


def _error_ref(description: str) -> dict[str, Any]:
    return _json_ref(description, ErrorResponse)


def _json_ref(description: str, model: type[BaseModel]) -> dict[str, Any]:
    ref = {"$ref": SCHEMA_REF.format(model=model.__name__)}
    return {"description": description, "content": {"application/json": {"schema": ref}}}
