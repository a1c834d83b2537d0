"""Protocol checks: what every client relies on, whoever serves."""

from __future__ import annotations

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
    ]
