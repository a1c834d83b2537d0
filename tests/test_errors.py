"""OpenAI-shaped errors: body, statuses, JSON responses, SSE error events, pickling."""

from __future__ import annotations

import pickle

import orjson
import pytest

from serve_app import errors
from serve_app.errors import ForgeError


def test_body_has_the_openai_shape():
    err = ForgeError(400, "bad", type="invalid_request_error", code="invalid_value", param="n")
    assert err.body() == {
        "error": {
            "message": "bad",
            "type": "invalid_request_error",
            "code": "invalid_value",
            "param": "n",
        }
    }
    assert str(err) == "bad"


def test_code_and_param_default_to_null():
    assert ForgeError(500, "x", type="api_error").body()["error"] == {
        "message": "x",
        "type": "api_error",
        "code": None,
        "param": None,
    }


@pytest.mark.parametrize(
    ("err", "status", "type_", "code"),
    [
        (errors.invalid_request("m"), 400, "invalid_request_error", "invalid_value"),
        (errors.invalid_api_key(), 401, "invalid_request_error", "invalid_api_key"),
        (errors.model_not_found("gpt-x"), 404, "invalid_request_error", "model_not_found"),
        (errors.not_found("/v2"), 404, "invalid_request_error", "not_found"),
        (
            errors.method_not_allowed("GET", "/v1/x"),
            405,
            "invalid_request_error",
            "method_not_allowed",
        ),
        (errors.payload_too_large(10), 413, "invalid_request_error", "request_too_large"),
        (errors.internal_error(), 500, "api_error", "internal_error"),
        (errors.bad_gateway(), 502, "api_error", "bad_gateway"),
        (errors.backend_unavailable(), 503, "api_error", "backend_unavailable"),
        (errors.upstream_timeout(), 504, "api_error", "upstream_timeout"),
    ],
)
def test_constructor_statuses(err, status, type_, code):
    assert (err.status, err.type, err.code) == (status, type_, code)


def test_invalid_request_carries_param_and_code():
    err = errors.invalid_request("m", param="messages.0.role", code="missing_required_parameter")
    assert (err.param, err.code) == ("messages.0.role", "missing_required_parameter")


def test_model_not_found_names_model_and_param():
    err = errors.model_not_found("gpt-x")
    assert "`gpt-x`" in err.message and err.param == "model"


def test_payload_too_large_names_the_limit():
    assert "1024 bytes" in errors.payload_too_large(1024).message


def test_error_response_is_json_with_status():
    response = errors.error_response(errors.model_not_found("m"))
    assert response.status_code == 404
    assert response.headers["content-type"] == "application/json"
    assert orjson.loads(response.body) == errors.model_not_found("m").body()


def test_503_response_has_retry_after():
    response = errors.error_response(errors.backend_unavailable())
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"


def test_401_response_has_www_authenticate():
    response = errors.error_response(errors.invalid_api_key())
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"


def test_error_response_merges_extra_headers():
    response = errors.error_response(errors.backend_unavailable(), {"x-request-id": "r1"})
    assert response.headers["x-request-id"] == "r1"
    assert response.headers["retry-after"] == "1"


def test_errors_without_headers_send_none():
    response = errors.error_response(errors.bad_gateway())
    assert "retry-after" not in response.headers
    assert "www-authenticate" not in response.headers


def test_error_event_is_an_sse_frame_with_the_body():
    err = errors.bad_gateway("replica died")
    event = errors.error_event(err)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n\n") == 1
    assert orjson.loads(event[len(b"data: ") :]) == err.body()


def test_pickle_round_trip_keeps_every_field():
    # Replicas raise ForgeErrors across Ray's process boundary.
    err = ForgeError(
        503,
        "busy",
        type="api_error",
        code="backend_unavailable",
        param="p",
        headers={"retry-after": "3"},
    )
    copy = pickle.loads(pickle.dumps(err))
    assert isinstance(copy, ForgeError)
    assert (copy.status, copy.message, copy.type, copy.code, copy.param, copy.headers) == (
        503,
        "busy",
        "api_error",
        "backend_unavailable",
        "p",
        {"retry-after": "3"},
    )
    assert copy.body() == err.body()
    assert str(copy) == "busy"
