"""The usage and admin API (``serve_app/admin/api.py``) as the gateway serves it: through httpx's
``ASGITransport`` into a gateway wired in process, with the embedded store and a real board."""

from __future__ import annotations

import asyncio
import datetime as dt
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from openapi_spec_validator import validate
from starlette.routing import Route

from serve_app.admin.openapi import SCHEMA_REF, add_component
from serve_app.admission import warm_slots
from serve_app.auth.keys import AdminKeys, hash_key
from serve_app.config.live import application_config
from serve_app.config.models import load_config
from serve_app.dialects.messages import MessagesRequest
from serve_app.dialects.responses import ResponsesRequest
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.metering.book import BookError
from serve_app.metering.ledger import UsageRecord
from serve_app.metering.sqlite import SqliteBook
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from serve_app.resilience.board import BreakerBoard, ServeBoard
from serve_app.resilience.breaker import State
from serve_app.store import MemoryStore, StoreUnavailable
from tests.polling import eventually_async

ALPHA_KEY = "sk-test-admin-api-alpha"
BETA_KEY = "sk-test-admin-api-beta"
ADMIN_KEY = "sk-test-admin-api-admin"
MODEL = "forge-sim"
OTHER_MODEL = "other-model"
FAST = {"prefill_base_s": 0.0, "decode_base_s": 0.0, "output_tokens_min": 4, "output_tokens_max": 8}
PRICE = {"prompt_per_million": 2.0, "completion_per_million": 8.0, "cached_per_million": 0.5}
ADMIN_ROUTES = [
    ("GET", "/admin/usage"),
    ("GET", "/admin/status"),
    ("GET", "/admin/breakers"),
    ("POST", "/admin/breakers/reset"),
    ("POST", "/admin/faults"),
]


def forge_args(**extra) -> dict:
    return {
        "tenants": [
            {"name": "alpha", "key_hashes": [hash_key(ALPHA_KEY)]},
            {"name": "beta", "key_hashes": [hash_key(BETA_KEY)]},
        ],
        "pools": [{"name": "primary", "model": MODEL, "engine": FAST}],
        "metering": {"currency": "EUR", "prices": {MODEL: PRICE}},
        "admin": {"key_hashes": [hash_key(ADMIN_KEY)]},
        "faults": {"enabled": True},
        **extra,
    }


class FailingBook(SqliteBook):
    """The ledger's file, except that reading fails as a database gone away would."""

    async def read(self, tenants, first_day, last_day):
        raise BookError("usage ledger down (test)")


@pytest.fixture
def board() -> BreakerBoard:
    return BreakerBoard()


@pytest.fixture
async def gateway(board: BreakerBoard) -> AsyncIterator[Gateway]:
    gateway = build_local_gateway(load_config(forge_args()), board=board)
    async with gateway.lifespan():
        yield gateway


def http(gateway: Gateway, key: str | None = None) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(gateway.asgi_app()),
        base_url="http://forge.test",
        headers=headers,
    )


def assert_error(response: httpx.Response, status: int, type: str, code: str | None = None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["type"] == type
    if code is not None:
        assert error["code"] == code
    return error


async def record(gateway: Gateway, tenant: str, model: str, day: str, **counts: int) -> None:
    gateway.ledger.add(UsageRecord(tenant, model, day, counts))
    await gateway.ledger.flush()


def today() -> str:
    return dt.datetime.now(dt.UTC).date().isoformat()


# -- who may call what -----------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
async def test_admin_routes_want_an_admin_key(gateway: Gateway, method: str, path: str):
    async with http(gateway) as anonymous:
        assert_error(await anonymous.request(method, path), 401, "invalid_request_error")
        malformed = await anonymous.request(method, path, headers={"authorization": ADMIN_KEY})
        assert_error(malformed, 401, "invalid_request_error", "invalid_api_key")
    async with http(gateway, "sk-not-a-key") as unknown:
        assert_error(
            await unknown.request(method, path), 401, "invalid_request_error", "invalid_api_key"
        )
    async with http(gateway, ALPHA_KEY) as tenant:
        error = assert_error(
            await tenant.request(method, path), 403, "permission_error", "admin_key_required"
        )
        assert "admin key" in error["message"]
    async with http(gateway, ADMIN_KEY) as admin:
        body = {"pool": "primary", "fault": {"mode": "none"}} if path == "/admin/faults" else None
        assert (await admin.request(method, path, json=body)).status_code == 200


async def test_usage_wants_a_tenants_key_not_an_admin_key(gateway: Gateway):
    async with http(gateway) as anonymous:
        assert_error(
            await anonymous.get("/v1/usage"), 401, "invalid_request_error", "invalid_api_key"
        )
    async with http(gateway, ADMIN_KEY) as admin:
        error = assert_error(await admin.get("/v1/usage"), 403, "permission_error")
        assert "/admin/usage" in error["message"]


async def test_admin_keys_come_from_the_config_and_its_mounted_file(tmp_path):
    extra = "sk-test-admin-from-file"
    secret = tmp_path / "admin-keys.yaml"
    secret.write_text(f"- {hash_key(extra)}\n")
    args = forge_args(admin={"key_hashes": [hash_key(ADMIN_KEY)], "key_hashes_file": str(secret)})
    keys = AdminKeys.from_config(load_config(args))
    assert keys.is_admin(f"Bearer {ADMIN_KEY}")
    assert keys.is_admin(f"bearer {extra}")
    assert not keys.is_admin(f"Bearer {ALPHA_KEY}")


@pytest.mark.parametrize(
    "content",
    [
        "{alpha: [not-a-hash]}",  # a mapping is the tenants' file, not the admins'
        "- not-a-hash\n",
        f"- {hash_key(ALPHA_KEY)}\n",  # a tenant's key
    ],
)
def test_a_bad_admin_keys_file_stops_start_up(tmp_path, content: str):
    secret = tmp_path / "admin-keys.yaml"
    secret.write_text(content)
    args = forge_args(admin={"key_hashes_file": str(secret)})
    with pytest.raises(ValueError, match="admin"):
        AdminKeys.from_config(load_config(args))


# -- usage ---------------------------------------------------------------------------------


async def test_a_tenant_sees_its_own_usage_only(gateway: Gateway):
    await record(gateway, "alpha", MODEL, "2025-03-01", requests=2, prompt_tokens=10)
    await record(gateway, "alpha", MODEL, "2025-03-02", requests=1, completion_tokens=7)
    await record(gateway, "beta", MODEL, "2025-03-01", requests=5, prompt_tokens=99)
    query = {"start": "2025-03-01", "end": "2025-03-02"}
    async with http(gateway, ALPHA_KEY) as alpha:
        by_day = (await alpha.get("/v1/usage", params=query)).json()
        total = (await alpha.get("/v1/usage", params={**query, "group": "total"})).json()
    assert [(r["tenant"], r["date"], r["requests"]) for r in by_day["data"]] == [
        ("alpha", "2025-03-01", 2),
        ("alpha", "2025-03-02", 1),
    ]
    assert by_day["start"] == "2025-03-01" and by_day["group"] == "day"
    assert "prices" not in by_day  # a tenant's report carries no price list
    (line,) = total["data"]
    assert line["date"] is None
    assert (line["requests"], line["prompt_tokens"], line["completion_tokens"]) == (3, 10, 7)
    assert line["errors"] == {
        "invalid": 0,
        "rate_limited": 0,
        "upstream": 0,
        "disconnected": 0,
        "truncated": 0,
    }


async def test_usage_defaults_to_today_and_filters_by_model(gateway: Gateway):
    await record(gateway, "alpha", MODEL, today(), requests=1)
    await record(gateway, "alpha", OTHER_MODEL, today(), requests=4)
    async with http(gateway, ALPHA_KEY) as alpha:
        report = (await alpha.get("/v1/usage")).json()
        only = (await alpha.get("/v1/usage", params={"model": OTHER_MODEL})).json()
    assert report["start"] == report["end"] == today()
    assert {r["model"]: r["requests"] for r in report["data"]} == {MODEL: 1, OTHER_MODEL: 4}
    assert [r["model"] for r in only["data"]] == [OTHER_MODEL]


async def test_a_served_request_shows_in_its_tenants_usage(board: BreakerBoard):
    args = forge_args()
    args["metering"]["flush_s"] = 0.01  # usage written every 10 ms, not every second
    gateway = build_local_gateway(load_config(args), board=board)
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    # From yesterday: a test that runs across midnight (UTC) still finds its request.
    yesterday = (dt.datetime.now(dt.UTC).date() - dt.timedelta(days=1)).isoformat()
    query = {"start": yesterday, "group": "total"}
    async with gateway.lifespan(), http(gateway, ALPHA_KEY) as alpha:
        answer = await alpha.post("/v1/chat/completions", json=ask)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]

        for _ in range(500):  # metering writes off the request path: poll the report for it
            data = (await alpha.get("/v1/usage", params=query)).json()["data"]
            if data:
                break
            await asyncio.sleep(0.01)
        (line,) = data
    assert (line["tenant"], line["model"], line["requests"]) == ("alpha", MODEL, 1)
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"]


async def test_admin_usage_covers_every_tenant_with_prices(gateway: Gateway):
    await record(gateway, "alpha", MODEL, "2025-03-01", requests=2, prompt_tokens=10)
    await record(gateway, "beta", MODEL, "2025-03-01", requests=5, prompt_tokens=99)
    query = {"start": "2025-03-01", "end": "2025-03-01", "group": "total"}
    async with http(gateway, ADMIN_KEY) as admin:
        everyone = (await admin.get("/admin/usage", params=query)).json()
        beta = (await admin.get("/admin/usage", params={**query, "tenant": "beta"})).json()
        unknown = await admin.get("/admin/usage", params={**query, "tenant": "gamma"})
    assert [(r["tenant"], r["requests"]) for r in everyone["data"]] == [("alpha", 2), ("beta", 5)]
    assert everyone["currency"] == "EUR"
    assert everyone["prices"] == {MODEL: PRICE}
    assert [r["tenant"] for r in beta["data"]] == ["beta"]
    error = assert_error(unknown, 404, "invalid_request_error", "tenant_not_found")
    assert error["param"] == "tenant"


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"start": "2025-13-01"}, "start"),
        ({"start": "2025-02-30"}, "start"),
        ({"end": "2025/03/01"}, "end"),
        ({"end": "20250301"}, "end"),
        ({"start": "2025-03-01T00:00:00"}, "start"),
        ({"start": "2025-03-02", "end": "2025-03-01"}, "end"),  # reversed
        ({"start": "2024-01-01", "end": "2025-03-01"}, "start"),  # over 400 days
        ({"group": "week"}, "group"),
    ],
)
@pytest.mark.parametrize(("path", "key"), [("/v1/usage", ALPHA_KEY), ("/admin/usage", ADMIN_KEY)])
async def test_bad_query_values_are_400s_naming_the_parameter(
    gateway: Gateway, path: str, key: str, query: dict, param: str
):
    async with http(gateway, key) as client:
        response = await client.get(path, params=query)
    error = assert_error(response, 400, "invalid_request_error")
    assert error["param"] == param
    assert param in error["message"]


async def test_a_range_of_400_days_is_fine(gateway: Gateway):
    async with http(gateway, ALPHA_KEY) as alpha:
        response = await alpha.get("/v1/usage", params={"start": "2024-01-01", "end": "2025-02-03"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("path", "key"), [("/v1/usage", ALPHA_KEY), ("/admin/usage", ADMIN_KEY)])
async def test_a_failing_ledger_is_a_503_not_a_stack_trace(path: str, key: str, tmp_path):
    book = FailingBook(tmp_path / "usage.sqlite3")
    gateway = build_local_gateway(load_config(forge_args()), book=book)
    async with gateway.lifespan(), http(gateway, key) as client:
        response = await client.get(path)
    problem = assert_error(response, 503, "api_error")
    assert "usage ledger unavailable" in problem["message"].lower()
    assert response.headers["retry-after"]


# -- breakers --------------------------------------------------------------------------------


async def test_breakers_are_described_and_reset_one_or_all(gateway: Gateway, board: BreakerBoard):
    await board.sync([("primary", "trip", False, 1), ("fallback", "trip", False, 1)])
    await gateway.breakers.flush()
    assert gateway.breakers.state("primary") is State.OPEN
    async with http(gateway, ADMIN_KEY) as admin:
        described = (await admin.get("/admin/breakers")).json()
        assert {name: b["state"] for name, b in described.items()} == {
            "fallback": "open",
            "primary": "open",
        }
        assert described["primary"]["transitions"] == 1
        one = await admin.post("/admin/breakers/reset", json={"backend": "primary"})
        assert one.status_code == 200, one.text
        assert list(one.json()) == ["fallback"]
        # This replica sees the reset at once, not at its next sync.
        assert gateway.breakers.state("primary") is State.CLOSED
        assert gateway.breakers.state("fallback") is State.OPEN
        everything = await admin.post("/admin/breakers/reset")
        assert everything.json() == {}
    assert gateway.breakers.state("fallback") is State.CLOSED
    assert await board.describe() == {}


async def test_a_bad_reset_body_is_a_400(gateway: Gateway):
    async with http(gateway, ADMIN_KEY) as admin:
        not_json = await admin.post(
            "/admin/breakers/reset", content=b"{", headers={"content-type": "application/json"}
        )
        wrong_type = await admin.post("/admin/breakers/reset", json={"backend": 3})
    assert_error(not_json, 400, "invalid_request_error")
    assert assert_error(wrong_type, 400, "invalid_request_error")["param"] == "backend"


async def test_an_unreachable_board_is_a_503(gateway: Gateway, board: BreakerBoard, monkeypatch):
    async def down(*args):
        raise ConnectionError("board down (test)")

    monkeypatch.setattr(board, "describe", down)
    async with http(gateway, ADMIN_KEY) as admin:
        response = await admin.get("/admin/breakers")
    assert_error(response, 503, "api_error", "board_unavailable")


# -- status ----------------------------------------------------------------------------------


async def test_status_shows_the_store_its_errors_and_each_pools_replicas():
    """A gate reads here whether a Redis is configured and that its loss was counted."""

    class DownStore(MemoryStore):
        async def take(self, buckets, amounts):
            raise StoreUnavailable("redis down (test)")

    args = forge_args(store={"redis_url": "redis://127.0.0.1:1/0"})
    args["tenants"][0]["limits"] = {"rpm": 100}
    gateway = build_local_gateway(load_config(args), store=DownStore())
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with gateway.lifespan(), http(gateway, ADMIN_KEY) as admin:
        before = (await admin.get("/admin/status")).json()
        async with http(gateway, ALPHA_KEY) as alpha:
            served = await alpha.post("/v1/chat/completions", json=chat)
        after = (await admin.get("/admin/status")).json()
    assert served.status_code == 200, served.text  # the store fails open
    assert before["store"] == {"kind": "redis", "state": "closed", "errors": {}}
    assert after["store"]["errors"]["reserve"] >= 1
    assert after["pools"] == [
        {"name": "primary", "model": MODEL, "replicas": 1, "fallback": False, "admission": None}
    ]
    assert after["fallback"] is None


async def test_status_shows_admission_slots_by_tenant_while_held_and_after(monkeypatch):
    monkeypatch.setattr(warm_slots, "BOOKS_FLUSH_S", 0.01)  # parks reach it in 10 ms, not 1 s
    args = forge_args()
    args["pools"][0]["admission"] = {"max_inflight": 4, "queue_cap": 2}
    args["pools"][0]["engine"] = FAST | {"decode_base_s": 0.05}
    gateway = build_local_gateway(load_config(args))
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with gateway.lifespan(), http(gateway, ADMIN_KEY) as admin:
        async with (
            http(gateway, ALPHA_KEY) as alpha,
            alpha.stream("POST", "/v1/chat/completions", json=chat) as streaming,
        ):
            assert streaming.status_code == 200
            during = (await admin.get("/admin/status")).json()["pools"][0]["admission"]
            await streaming.aread()
        scheduler = gateway.schedulers["primary"].scheduler
        await eventually_async(  # a freed slot reaches the scheduler with the next batch of ops
            lambda: not any(scheduler.snapshot().inflight.values()),
            timeout_s=10,
            what="the freed slot at the scheduler",
            explain=lambda: scheduler.snapshot().inflight,
        )
        after = (await admin.get("/admin/status")).json()["pools"][0]["admission"]
    assert during["slots_total"] == 4
    assert during["inflight"] == {"alpha": 1, "beta": 0}
    assert after["inflight"] == {"alpha": 0, "beta": 0}


async def test_status_says_embedded_where_no_redis_is_configured(gateway: Gateway):
    async with http(gateway, ADMIN_KEY) as admin:
        status = (await admin.get("/admin/status")).json()
    assert status["store"]["kind"] == "embedded"


# -- routing ---------------------------------------------------------------------------------


async def test_a_fault_is_injected_on_every_replica_of_a_pool_and_cleared(gateway: Gateway):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with http(gateway, ADMIN_KEY) as admin, http(gateway, ALPHA_KEY) as tenant:
        injected = await admin.post(
            "/admin/faults", json={"pool": "primary", "fault": {"mode": "error"}}
        )
        assert injected.status_code == 200, injected.text
        replicas = injected.json()["replicas"]
        assert replicas and all(f["mode"] == "error" for f in replicas.values())
        failed = await tenant.post("/v1/chat/completions", json=chat)
        assert failed.status_code == 502  # no fallback configured here: the fault shows
        cleared = await admin.post(
            "/admin/faults", json={"pool": "primary", "fault": {"mode": "none"}}
        )
        assert all(f["mode"] == "none" for f in cleared.json()["replicas"].values())
        assert (await tenant.post("/v1/chat/completions", json=chat)).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"pool": "nope", "fault": {"mode": "error"}}, 404, "pool"),
        ({"pool": "primary", "fault": {"mode": "explode"}}, 400, "fault.mode"),
        ({"pool": "primary", "fault": {"mode": "slow", "factor": 0.5}}, 400, "fault.factor"),
        ({"pool": "primary"}, 400, "fault"),
    ],
)
async def test_a_bad_fault_is_refused_naming_the_field(gateway: Gateway, body, status, param):
    async with http(gateway, ADMIN_KEY) as admin:
        answer = await admin.post("/admin/faults", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/admin/nope", 404, "not_found"),
        ("GET", "/v2/anything", 404, "not_found"),
        ("DELETE", "/admin/usage", 405, "method_not_allowed"),
        ("GET", "/admin/breakers/reset", 405, "method_not_allowed"),
        ("GET", "/v1/chat/completions", 405, "method_not_allowed"),  # still the inference app's
        ("POST", "/v1/models", 405, "method_not_allowed"),
    ],
)
async def test_unknown_paths_and_wrong_methods_are_openai_shaped(
    gateway: Gateway, method: str, path: str, status: int, code: str
):
    async with http(gateway, ADMIN_KEY) as admin:
        response = await admin.request(method, path)
    assert_error(response, status, "invalid_request_error", code)
    if status == 405:
        assert response.headers["allow"]


async def test_the_inference_routes_stay_on_plain_starlette(gateway: Gateway):
    app = gateway.asgi_app()
    assert {type(r) for r in app.routes} == {Route}
    async with http(gateway) as anonymous:
        assert (await anonymous.get("/healthz")).json() == {"status": "ok"}
        assert (await anonymous.get("/docs")).status_code == 200


# -- the schema ------------------------------------------------------------------------------


@pytest.fixture
async def schema(gateway: Gateway) -> dict:
    async with http(gateway) as anonymous:
        response = await anonymous.get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def served_operations(gateway: Gateway) -> set[tuple[str, str]]:
    """Every (path, method) the gateway's ASGI app serves: its Starlette routes, then the admin
    app's (the router's default), less what only serves the docs themselves."""
    app = gateway.asgi_app()
    routes = [*app.routes, *app.router.default.routes]
    return {
        (re.sub(r"{(\w+):\w+}", r"{\1}", route.path), method.lower())  # as OpenAPI writes it
        for route in routes
        if getattr(route, "include_in_schema", True)
        for method in route.methods
        if method != "HEAD"
    }


async def test_the_schema_is_valid_openapi(schema: dict):
    validate(schema)


async def test_the_schema_lists_every_route_the_gateway_serves(gateway: Gateway, schema: dict):
    listed = {(path, method) for path, ops in schema["paths"].items() for method in ops}
    served = served_operations(gateway)
    assert {("/v1/chat/completions", "post"), ("/admin/usage", "get")} <= served
    assert served == listed


async def test_every_operation_documents_its_errors_and_no_422(schema: dict):
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (path, method)
            if path in {"/healthz", "/readyz"}:
                continue
            # The inference routes take the key as Anthropic's SDK sends it too; admin and
            # usage routes only as a bearer. The Messages routes answer in Anthropic's shape.
            inference = operation["tags"] == ["inference"]
            keys = [{"bearer": []}, {"x-api-key": []}] if inference else [{"bearer": []}]
            assert operation["security"] == keys, (path, method)
            shape = "AnthropicError" if path.startswith("/v1/messages") else "ErrorResponse"
            assert responses["401"]["content"]["application/json"]["schema"] == {
                "$ref": SCHEMA_REF.format(model=shape)
            }, (path, method)
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert "HTTPValidationError" not in schema["components"]["schemas"]


@pytest.mark.parametrize(
    ("path", "model"),
    [
        ("/v1/chat/completions", ChatCompletionRequest),
        ("/v1/completions", CompletionRequest),
        ("/v1/responses", ResponsesRequest),
        ("/v1/messages", MessagesRequest),
    ],
)
async def test_request_schemas_are_the_wire_types_own(schema: dict, path: str, model: type):
    """A drift test: the documented body is what ``serve_app/protocol.py`` validates."""
    body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": SCHEMA_REF.format(model=model.__name__)}
    own = model.model_json_schema(ref_template=SCHEMA_REF)
    for name, definition in {**own.pop("$defs", {}), model.__name__: own}.items():
        assert schema["components"]["schemas"][name] == definition, name


def test_a_schema_name_taken_twice_is_an_error():
    components: dict = {"ChatMessage": {"type": "string"}}
    with pytest.raises(ValueError, match="ChatMessage"):
        add_component(components, ChatCompletionRequest)


def test_the_local_config_has_a_demo_admin_key():
    import yaml

    with open(Path(__file__).resolve().parents[2] / "configs" / "local.yaml") as f:
        config = application_config(yaml.safe_load(f)["applications"][0])
    assert AdminKeys.from_config(config).is_admin("Bearer sk-demo-admin-local-only")


class _Method:
    """One method of a stub ``DeploymentHandle``: ``.remote(...)`` is awaitable, as Serve's is."""

    def __init__(self, call) -> None:
        self.call = call

    def remote(self, *args):
        return self.call(*args)


class _Handle:
    def __init__(self, board: BreakerBoard) -> None:
        self.calls: list[str] = []
        self.board = board

    def __getattr__(self, name: str) -> _Method:
        self.calls.append(name)
        return _Method(getattr(self.board, name))


async def test_the_serve_board_passes_describe_and_reset_through(board: BreakerBoard):
    await board.sync([("primary", "trip", False, 1)])
    handle = _Handle(board)
    serve_board = ServeBoard(handle)
    assert (await serve_board.describe())["primary"]["state"] == "open"
    assert await serve_board.reset("primary") == {}
    assert handle.calls == ["describe", "reset"]
    assert await board.describe() == {}


async def test_fault_injection_is_refused_with_403_where_the_config_leaves_it_off():
    args = forge_args()
    del args["faults"]  # the default: off, as on the cluster (configs/gke.yaml)
    gateway = build_local_gateway(load_config(args))
    async with gateway.lifespan(), http(gateway, ADMIN_KEY) as admin:
        answer = await admin.post(
            "/admin/faults", json={"pool": "primary", "fault": {"mode": "crash"}}
        )
        status = (await admin.get("/admin/status")).json()
    problem = assert_error(answer, 403, "permission_error")
    assert problem["code"] == "faults_disabled"
    assert status["faults"] is False
    assert gateway.backends["primary"].pool.replica_count() > 0, "no replica was crashed"
