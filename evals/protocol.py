"""Protocol checks: what every client relies on, whoever serves."""

from __future__ import annotations

import json
import uuid

import httpx

from evals.gate import Check, Served, Skipped, expect
from evals.target import Target


def _openai_error(response: httpx.Response, status: int, what: str) -> dict:
    expect(response.status_code == status, f"{what}: {response.status_code}, wanted {status}")
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        expect(False, f"{what}: not an OpenAI-shaped error: {response.text[:120]!r}")
    for field in ("message", "type", "code"):
        expect(field in error, f"{what}: error without {field!r}: {error}")
    expect(error["message"], f"{what}: empty error message")
    return error


async def models_listed(target: Target, served: Served) -> str:
    async with target.openai() as client:
        models = [m.id async for m in client.models.list()]
    expect(target.model in models, f"{target.model} not in {models}")
    return f"{len(models)} models"


async def no_key_is_401(target: Target, served: Served) -> None:
    async with target.http(None) as client:
        response = await client.post("/v1/chat/completions", json=target.chat_body("hi"))
    _openai_error(response, 401, "no key")


async def wrong_key_is_401(target: Target, served: Served) -> None:
    async with target.http(f"sk-gate-wrong-{uuid.uuid4().hex}") as client:
        response = await client.post("/v1/chat/completions", json=target.chat_body("hi"))
    _openai_error(response, 401, "wrong key")


async def tenant_on_admin_is_403(target: Target, served: Served) -> None:
    async with target.http(admin=True) as client:
        response = await client.get("/admin/status")
    _openai_error(response, 403, "a tenant's key on /admin/status")


async def admin_not_on_the_clients_listener(target: Target, served: Served) -> str:
    if not target.admin_listener:
        raise Skipped("the operator's routes share the base URL (no --admin-url)")
    async with target.http() as client:
        for path in ("/admin/status", "/admin/faults", "/openapi.json"):
            response = await client.get(path)
            _openai_error(response, 404, f"{path} on the clients' listener")
    return "/admin/*, /openapi.json: 404 on the clients' listener"


async def request_id_echoed(target: Target, served: Served) -> None:
    rid = f"gate-{uuid.uuid4().hex}"
    async with target.http() as client:
        response = await client.post(
            "/v1/chat/completions",
            json=target.chat_body("echo my id", max_tokens=4),
            headers={"x-request-id": rid, "cache-control": "no-store"},
        )
        served.saw(response.headers.get("x-forge-backend"))
        minted = await client.post("/v1/chat/completions", json={})  # a 400 has one too
    expect(response.status_code == 200, f"{response.status_code}: {response.text[:120]}")
    expect(response.headers.get("x-request-id") == rid, "x-request-id not echoed")
    expect(minted.headers.get("x-request-id"), "no x-request-id minted on an error")


async def oversized_body_is_413(target: Target, served: Served) -> str:
    size = target.profile.oversize_bytes
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * size + b'"}]}'
    async with target.http() as client:
        response = await client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
    _openai_error(response, 413, f"a {size}-byte body")
    return f"{size} bytes"


async def bad_requests_are_400s(target: Target, served: Served) -> None:
    async with target.http() as client:
        missing = await client.post("/v1/chat/completions", json={"model": target.model})
        broken = await client.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        negative = await client.post(
            "/v1/chat/completions", json=target.chat_body("hi", max_tokens=-1)
        )
    _openai_error(missing, 400, "no messages")
    _openai_error(broken, 400, "malformed JSON")
    _openai_error(negative, 400, "max_tokens -1")


async def unknown_model_is_404(target: Target, served: Served) -> None:
    async with target.http() as client:
        response = await client.post(
            "/v1/chat/completions", json=target.chat_body("hi") | {"model": "no-such-model"}
        )
    error = _openai_error(response, 404, "an unknown model")
    expect(error["code"] == "model_not_found", f"code {error['code']!r}")


def _events(text: str) -> list[tuple[str, dict]]:
    """A Responses or Messages stream's events: (the event line, its JSON data)."""
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields and "data" in fields:
            out.append((fields["event"], json.loads(fields["data"])))
    return out


async def responses_route(target: Target, served: Served) -> str:
    """``/v1/responses`` as the Agents SDK and Codex use it: an answer, its stream, a stored
    response read back and deleted, ``store: false`` leaving nothing."""
    body = {"model": target.model, "input": "Say hello.", "max_output_tokens": 8}
    async with target.http() as client:
        plain = await client.post("/v1/responses", json=body)
        expect(plain.status_code == 200, f"{plain.status_code}: {plain.text[:160]}")
        served.saw(plain.headers.get("x-forge-backend"))
        response = plain.json()
        expect(response["object"] == "response", f"object {response.get('object')!r}")
        expect(response["status"] in ("completed", "incomplete"), f"{response['status']!r}")
        expect(response["usage"]["output_tokens"] > 0, f"usage {response['usage']}")
        stored = await client.get(f"/v1/responses/{response['id']}")
        expect(stored.status_code == 200, f"GET a stored response: {stored.status_code}")
        expect(stored.json()["id"] == response["id"], "GET answered another response")
        deleted = await client.delete(f"/v1/responses/{response['id']}")
        expect(deleted.status_code == 200, f"DELETE: {deleted.status_code}")
        gone = await client.get(f"/v1/responses/{response['id']}")
        _openai_error(gone, 404, "a deleted response")
        unkept = await client.post("/v1/responses", json=body | {"store": False})
        expect(unkept.status_code == 200, f"store false: {unkept.status_code}")
        absent = await client.get(f"/v1/responses/{unkept.json()['id']}")
        _openai_error(absent, 404, "a response sent with store: false")
        streamed = await client.post("/v1/responses", json=body | {"stream": True})
    kinds = [kind for kind, _ in _events(streamed.text)]
    expect(streamed.status_code == 200, f"stream: {streamed.status_code}")
    expect(kinds[:1] == ["response.created"], f"a stream that starts with {kinds[:1]}")
    expect(
        kinds[-1:] in (["response.completed"], ["response.incomplete"]),
        f"a stream that ends with {kinds[-1:]}",
    )
    return f"{len(kinds)} events streamed; stored, read back, deleted"


async def messages_route(target: Target, served: Served) -> str:
    """``/v1/messages`` as Claude Code and the anthropic SDK use it: the key in ``x-api-key``,
    an answer, its stream, and an error in Anthropic's shape."""
    body = {
        "model": target.model,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say hello."}],
    }
    headers = {"x-api-key": target.key, "anthropic-version": "2023-06-01"}
    async with target.http(None) as client:
        plain = await client.post("/v1/messages", json=body, headers=headers)
        streamed = await client.post("/v1/messages", json=body | {"stream": True}, headers=headers)
        refused = await client.post("/v1/messages", json={"model": target.model}, headers=headers)
    expect(plain.status_code == 200, f"{plain.status_code}: {plain.text[:160]}")
    served.saw(plain.headers.get("x-forge-backend"))
    message = plain.json()
    expect(message["type"] == "message" and message["content"], f"{str(message)[:160]}")
    expect(message["usage"]["output_tokens"] > 0, f"usage {message['usage']}")
    kinds = [kind for kind, _ in _events(streamed.text)]
    expect(kinds[:1] == ["message_start"], f"a stream that starts with {kinds[:1]}")
    expect(kinds[-1:] == ["message_stop"], f"a stream that ends with {kinds[-1:]}")
    expect(refused.status_code == 400, f"no max_tokens: {refused.status_code}, wanted 400")
    error = refused.json()
    expect(
        error.get("type") == "error" and error["error"]["type"] == "invalid_request_error",
        f"not Anthropic's error shape: {refused.text[:160]}",
    )
    return f"{len(kinds)} events streamed; x-api-key; Anthropic-shaped 400"


def checks() -> list[Check]:
    return [
        Check("protocol:models-listed", models_listed, "protocol"),
        Check("protocol:no-key-401", no_key_is_401, "protocol"),
        Check("protocol:wrong-key-401", wrong_key_is_401, "protocol"),
        Check("protocol:tenant-on-admin-403", tenant_on_admin_is_403, "protocol"),
        Check("protocol:admin-off-clients-port", admin_not_on_the_clients_listener, "protocol"),
        Check("protocol:request-id-echoed", request_id_echoed, "protocol"),
        Check("protocol:oversized-body-413", oversized_body_is_413, "protocol"),
        Check("protocol:bad-request-400", bad_requests_are_400s, "protocol"),
        Check("protocol:unknown-model-404", unknown_model_is_404, "protocol"),
        Check("protocol:responses-api", responses_route, "protocol"),
        Check("protocol:messages-api", messages_route, "protocol"),
    ]
