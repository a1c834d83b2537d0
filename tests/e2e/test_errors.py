"""Every failure a client can cause or meet is an OpenAI-shaped error with the right status."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import ALPHA_KEY

pytestmark = pytest.mark.e2e

CHAT = [{"role": "user", "content": "hello"}]
AUTH = {"authorization": f"Bearer {ALPHA_KEY}"}


def _assert_openai_error(response: httpx.Response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert "Traceback" not in error["message"]
    if code:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"authorization": "Bearer sk-wrong"},
        {"authorization": "Basic abc"},
        {"authorization": ""},
    ],
)
def test_missing_or_wrong_key_is_401(forge_url, headers):
    response = httpx.post(
        f"{forge_url}/v1/chat/completions",
        json={"model": "forge-sim", "messages": CHAT},
        headers=headers,
    )
    _assert_openai_error(response, 401, "invalid_api_key")


def test_401_comes_before_body_parsing(forge_url):
    response = httpx.post(f"{forge_url}/v1/chat/completions", content=b"{not json")
    _assert_openai_error(response, 401, "invalid_api_key")


def test_models_needs_a_key(forge_url):
    _assert_openai_error(httpx.get(f"{forge_url}/v1/models"), 401, "invalid_api_key")


def test_openai_client_raises_authentication_error(forge_url):
    client = openai.OpenAI(base_url=f"{forge_url}/v1", api_key="sk-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="forge-sim", messages=CHAT)


def test_malformed_json_is_400(forge_url):
    response = httpx.post(
        f"{forge_url}/v1/chat/completions", content=b'{"model": "forge-sim",', headers=AUTH
    )
    _assert_openai_error(response, 400, "invalid_json")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "forge-sim"}, "messages"),
        ({"model": "forge-sim", "messages": []}, "messages"),
        (
            {"model": "forge-sim", "messages": [{"role": "wizard", "content": "x"}]},
            "messages.0.role",
        ),
        ({"model": "forge-sim", "messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"model": "forge-sim", "messages": CHAT, "temperature": 7}, "temperature"),
        ({"model": "forge-sim", "messages": CHAT, "n": 3}, "n"),
        ({"messages": CHAT}, "model"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(forge_url, body, param):
    response = httpx.post(f"{forge_url}/v1/chat/completions", json=body, headers=AUTH)
    error = _assert_openai_error(response, 400)
    assert error["param"] == param


def test_openai_client_raises_bad_request(openai_client):
    with pytest.raises(openai.BadRequestError):
        openai_client.chat.completions.create(model="forge-sim", messages=CHAT, max_tokens=-1)


def test_max_tokens_past_the_models_context_is_400_from_the_replica(openai_client):
    """As vLLM refuses it (a max_tokens within the context but past what the prompt leaves is
    cut to it: tests/engines/contract.py)."""
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model="forge-sim", messages=CHAT, max_tokens=100_000)
    assert (info.value.code, info.value.param) == ("invalid_value", "max_tokens")
    assert "max_model_len" in info.value.message


def test_unknown_model_is_404(openai_client):
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.chat.completions.create(model="gpt-17", messages=CHAT)
    assert info.value.code == "model_not_found"


def test_body_over_limit_is_413(forge_url):
    huge = "x" * (65 * 1024)
    response = httpx.post(
        f"{forge_url}/v1/chat/completions",
        json={"model": "forge-sim", "messages": [{"role": "user", "content": huge}]},
        headers=AUTH,
    )
    _assert_openai_error(response, 413, "request_too_large")


def test_unknown_route_and_wrong_method_are_openai_errors(forge_url):
    _assert_openai_error(httpx.get(f"{forge_url}/v1/nothing-here", headers=AUTH), 404)
    _assert_openai_error(httpx.get(f"{forge_url}/v1/chat/completions", headers=AUTH), 405)


def test_replica_failure_is_502(openai_client, faults):
    faults.set_all("pool-solo", {"mode": "error"})
    with pytest.raises(openai.InternalServerError) as info:
        openai_client.chat.completions.create(model="forge-solo", messages=CHAT, max_tokens=3)
    assert info.value.status_code == 502
    assert info.value.code == "bad_gateway"


def test_hung_replica_is_504_not_a_hang(openai_client, faults):
    faults.set_all("pool-solo", {"mode": "hang"})
    with pytest.raises(openai.InternalServerError) as info:
        openai_client.chat.completions.create(
            model="forge-solo", messages=CHAT, max_tokens=3, stream=True
        )
    assert info.value.status_code == 504


def test_hung_replica_without_streaming_is_504_not_a_hang(openai_client, faults):
    faults.set_all("pool-solo", {"mode": "hang"})
    with pytest.raises(openai.InternalServerError) as info:
        openai_client.chat.completions.create(model="forge-solo", messages=CHAT, max_tokens=3)
    assert info.value.status_code == 504


def test_full_pool_is_503(forge_url, openai_client, faults):
    faults.set_all("pool-solo", {"mode": "hang"})
    body = {"model": "forge-solo", "messages": CHAT, "max_tokens": 3, "stream": True}
    # The pool has one slot and each gateway replica may queue one more request for it: of six
    # requests at once, one runs (and hangs), some queue, and the rest are refused at once.
    results: list[httpx.Response] = []

    def send() -> None:
        results.append(
            httpx.post(f"{forge_url}/v1/chat/completions", json=body, headers=AUTH, timeout=10)
        )

    threads = [threading.Thread(target=send) for _ in range(6)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join()
    refused = [r for r in results if r.status_code == 503]
    assert refused, [r.status_code for r in results]
    error = _assert_openai_error(refused[0], 503, "backend_at_capacity")
    assert refused[0].headers["retry-after"]
    assert error["type"] == "api_error"
    assert {r.status_code for r in results} <= {503, 504}


def test_primary_failure_before_first_byte_fails_over_to_fallback(openai_client, faults):
    faults.set_all("pool-primary", {"mode": "error"})
    raw = openai_client.chat.completions.with_raw_response.create(
        model="forge-sim", messages=CHAT, max_tokens=4, stream=True
    )
    assert raw.headers["x-forge-backend"] == "fallback"
    chunks = list(raw.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()


def test_stream_dying_mid_way_ends_with_an_error_event_not_splice(openai_client, faults):
    faults.set_all(
        "pool-solo", {"mode": "die_mid_stream", "after_frames": 3, "exit_process": False}
    )
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in openai_client.chat.completions.create(
            model="forge-solo", messages=CHAT, max_tokens=20, stream=True
        ):
            received.extend(c.delta.content or "" for c in chunk.choices)
    assert "stream died" in str(info.value)
    assert 0 < len([r for r in received if r]) < 20, "partial text, then the error; no retry"
