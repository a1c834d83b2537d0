"""The usage and admin API: FastAPI beside the lean inference routes, and the gateway's schema.

Inference stays on plain Starlette routes (``gateway/server.py``): the hot path pays for no
dependency injection or response-model validation. What is here is read rarely and wants a typed,
documented surface instead:

- ``GET /v1/usage`` (a tenant's key): that tenant's own usage;
- ``GET /admin/usage`` (an admin key): every tenant's, with the configured prices;
- ``GET /admin/breakers`` and ``POST /admin/breakers/reset`` (an admin key): the breaker board;
- ``POST /admin/faults`` (an admin key): a fault injected on every replica of a pool, or
  cleared (failover drills, the eval gate);
- ``GET /openapi.json`` and ``/docs``: the schema of every route the gateway serves, the
  inference routes included (merged in from the wire types of ``serve_app/protocol.py``).

Every failure is OpenAI-shaped through ``serve_app/errors.py``, FastAPI's own included: a bad
query value is a 400 that names the parameter (never FastAPI's 422 body), an unknown path a 404,
a wrong method a 405, an unreachable store a 503.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

import orjson
from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.responses import Response

from serve_app import errors
from serve_app.admin.openapi import BEARER, ErrorResponse, with_inference_routes
from serve_app.auth.keys import AdminKeys, KeyRing
from serve_app.auth.throttle import FailedAuthThrottle, authenticate
from serve_app.backends.base import PoolControl
from serve_app.config.models import ForgeConfig, ModelPrice, TenantConfig
from serve_app.dialects.messages import anthropic_error, speaks_anthropic
from serve_app.metering.book import BookError
from serve_app.metering.ledger import UsageLedger, UsageRow, date_range
from serve_app.replica.faults import FaultSpec
from serve_app.resilience.client import BreakerClient
from serve_app.store import StoreError

logger = logging.getLogger("ray.serve")

_DAY_FORMAT = re.compile(r"^\d{4}-\d{2}-\d{2}$")


# -- wire types (also the schema's components) ------------------------------------------------


class UsageErrors(BaseModel):
    """Failed requests by class (``serve_app.metering.ledger.error_class``)."""

    invalid: int = 0
    rate_limited: int = 0
    upstream: int = 0
    disconnected: int = 0
    truncated: int = 0


class UsageLine(BaseModel):
    """A tenant's usage of one model on one day, or over the whole range (``date`` null)."""

    tenant: str
    model: str
    date: dt.date | None
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_requests: int = 0
    cached_tokens: int = 0
    fallback_requests: int = 0
    estimated_requests: int = Field(
        0, description="Requests whose tokens are the gateway's estimate: no backend said."
    )
    errors: UsageErrors = UsageErrors()


class UsageReport(BaseModel):
    object: Literal["usage.report"] = "usage.report"
    start: dt.date
    end: dt.date
    group: Literal["day", "total"]
    data: list[UsageLine]


class AdminUsageReport(UsageReport):
    """Every tenant's usage, with what the configured prices need to cost it."""

    currency: str
    prices: dict[str, ModelPrice] = Field(description="Per served model; absent: unpriced.")


class BreakerView(BaseModel):
    state: Literal["closed", "half_open", "open"]
    retry_in_s: float
    consecutive_failures: int
    transitions: int
    probes: int
    probes_per_half_open: list[int]
    adopted: bool = Field(
        False, description="Taken on open from a gateway's copy by a new board (a restart)."
    )


class FaultRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pool: str = Field(description="The pool's name (configs: pools[].name), e.g. primary.")
    fault: FaultSpec = Field(description='What to inject; {"mode": "none"} clears it.')


class FaultsSet(BaseModel):
    pool: str
    replicas: dict[str, FaultSpec | None] = Field(
        description="Each replica's fault now; null for a replica that could not be reached."
    )


class StoreStatus(BaseModel):
    kind: Literal["redis", "embedded"]
    state: Literal["closed", "half_open", "open"] = Field(
        description="The store's breaker in this gateway replica: open while it skips the store."
    )
    errors: dict[str, int] = Field(
        description="Store calls this replica counted as failed, by op (forge_store_errors_total)."
    )


class AdmissionStatus(BaseModel):
    slots_total: int
    slots_used: int = Field(description="Slots held, parked ones included.")
    parked: int = Field(description="Slots gateways hold warm for their next request.")
    queued: dict[str, int] = Field(description="Requests waiting for a slot, by tenant.")
    inflight: dict[str, int] = Field(description="Slots serving a request, by tenant.")
    adopted_leases: int = Field(
        0, description="Leases a new scheduler took on from the gateways' reports (a restart)."
    )


class PoolStatus(BaseModel):
    name: str
    model: str
    replicas: int | None = Field(description="Replicas that can take a request; null: unknown.")
    fallback: bool = Field(description="Whether the fallback serves when this pool cannot.")
    admission: AdmissionStatus | None = Field(
        None, description="Fair admission's slots (pools with admission; null: none or unknown)."
    )


class RefusedConfig(BaseModel):
    digest: str = Field(description="The refused user_config's digest.")
    error: str = Field(description="Why, with each bad field's path.")
    started_from: str | None = Field(
        None,
        description="Set when this replica started while the target was bad: whose "
        "configuration it serves instead (a running replica's).",
    )


class LiveConfigStatus(BaseModel):
    digest: str = Field(description="The live configuration this replica serves.")
    applied_at: float = Field(description="When it was applied (Unix seconds).")
    refused: RefusedConfig | None = Field(
        description="The last change this replica refused since it applied one; null: none."
    )


class VariantWindow(BaseModel):
    requests: int
    errors: int = Field(description="5xx, or failed by the variant's pool before another served.")
    error_ratio: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None = Field(description="Of the answers the variant's own pool gave.")
    tpot_p95_s: float | None


class CanaryVerdict(BaseModel):
    decision: Literal["promote", "hold", "abort"]
    reasons: list[str]
    canary: VariantWindow
    stable: VariantWindow


class TrafficStatus(BaseModel):
    weights: dict[str, float] = Field(description="By variant, aborted ones at 0.")
    aborted: list[str] = Field(description="Variants the analysis set to 0 (auto_abort).")
    variants: dict[str, VariantWindow] = Field(description="Each variant's analysis window.")
    verdict: CanaryVerdict | None = Field(description="The analysis' verdict; null: none set.")
    analysis: dict[str, Any] | None = Field(description="The entry's analysis bounds.")


class GatewayStatus(BaseModel):
    store: StoreStatus
    pools: list[PoolStatus]
    fallback: str | None = Field(description="The fallback's model, if one is configured.")
    faults: bool = Field(description="Whether POST /admin/faults is on (faults.enabled).")
    config: LiveConfigStatus
    traffic: dict[str, TrafficStatus] = Field(
        default_factory=dict,
        description="Each models: entry, as this gateway replica served it (docs/traffic.md).",
    )
    shadow: dict[str, int] = Field(
        default_factory=dict, description="Shadow copies by model/pool/status, this replica's."
    )


class BreakerReset(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key must not mean "every breaker"

    backend: str | None = Field(
        None, description="primary, primary/<replica> or fallback; absent: every breaker."
    )


# -- who may call what -----------------------------------------------------------------------

_bearer = HTTPBearer(
    auto_error=False,
    scheme_name=BEARER,
    description="A tenant's API key (inference, /v1/usage) or an admin key (/admin/*).",
)
# Declared so the schema shows the bearer scheme on each route; the header is read raw below, so
# a missing, malformed or unknown key is worded as the inference routes word it.
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def require_admin(request: Request, _: Credentials) -> None:
    """An admin key passes; a tenant's key is a 403; anything else a 401."""
    authorization = request.headers.get("authorization")
    if request.app.state.admin_keys.is_admin(authorization):
        return
    _tenant(request, authorization)  # an unknown key: 401 (429 once throttled)
    raise errors.admin_key_required()


async def require_tenant(request: Request, _: Credentials) -> TenantConfig:
    """The caller's tenant; an admin key is a 403 (it has none); anything else a 401."""
    authorization = request.headers.get("authorization")
    if request.app.state.admin_keys.is_admin(authorization):
        raise errors.tenant_key_required()
    return _tenant(request, authorization)


def _tenant(request: Request, authorization: str | None) -> TenantConfig:
    state = request.app.state
    address = request.client.host if request.client else None
    return authenticate(state.keyring, authorization, address, state.auth_throttle)


# -- the app ---------------------------------------------------------------------------------

_DAY = {"json_schema_extra": {"format": "date"}, "examples": ["2025-01-31"]}
StartDay = Annotated[str | None, Query(description="first day, YYYY-MM-DD (UTC); today", **_DAY)]
EndDay = Annotated[str | None, Query(description="last day, YYYY-MM-DD (UTC); today", **_DAY)]
ModelFilter = Annotated[str | None, Query(description="only this served model")]
Grouping = Annotated[Literal["day", "total"], Query(description="a row per day, or per range")]


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse} for status in statuses}


def build_admin_api(
    config: ForgeConfig,
    keyring: KeyRing,
    ledger: UsageLedger,
    breakers: BreakerClient,
    pools: Mapping[str, PoolControl],
    status: Callable[[], Awaitable[dict]],
    auth_throttle: FailedAuthThrottle | None = None,
) -> FastAPI:
    """The usage and admin routes, and ``/openapi.json`` for the whole gateway. ``pools``: pool
    name → its control, for fault injection; ``status``: what ``/admin/status`` shows;
    ``auth_throttle``: the inference routes' own, so wrong keys count the same everywhere."""
    tenants = {t.name: t for t in config.tenants}
    backends = {p.name for p in config.pools} | ({"fallback"} if config.fallback else set())
    app = FastAPI(
        title="Forge",
        version="0.1.0",
        description=(
            "An OpenAI-compatible LLM gateway. Errors are OpenAI-shaped: "
            '`{"error": {"message", "type", "code", "param"}}`.'
        ),
        redoc_url=None,
        exception_handlers={
            HTTPException: http_error,
            RequestValidationError: _validation_error,
            errors.ForgeError: _forge_error,
            StoreError: _store_error,
            BookError: _book_error,
        },
        responses=_errors(401, 403),
    )

    @app.get(
        "/v1/usage",
        response_model=UsageReport,
        tags=["usage"],
        operation_id="tenant_usage",
        responses=_errors(400, 503),
    )
    async def usage(
        tenant: Annotated[TenantConfig, Depends(require_tenant)],
        start: StartDay = None,
        end: EndDay = None,
        model: ModelFilter = None,
        group: Grouping = "day",
    ) -> UsageReport:
        """The calling tenant's usage per model and day (or summed over the range)."""
        first, last = report_range(start, end)
        rows = await ledger.read([tenant.name], first, last, model=model, by_day=group == "day")
        return UsageReport(start=first, end=last, group=group, data=lines(rows))

    @app.get(
        "/admin/usage",
        operation_id="admin_usage",
        response_model=AdminUsageReport,
        tags=["admin"],
        responses=_errors(400, 404, 503),
        dependencies=[Depends(require_admin)],
    )
    async def admin_usage(
        start: StartDay = None,
        end: EndDay = None,
        tenant: Annotated[str | None, Query(description="only this tenant")] = None,
        model: ModelFilter = None,
        group: Grouping = "day",
    ) -> AdminUsageReport:
        """Every tenant's usage per model and day (or summed over the range), with prices."""
        if tenant is not None and tenant not in tenants:
            raise errors.tenant_not_found(tenant)
        first, last = report_range(start, end)
        names = [tenant] if tenant is not None else list(tenants)
        rows = await ledger.read(names, first, last, model=model, by_day=group == "day")
        return AdminUsageReport(
            start=first,
            end=last,
            group=group,
            data=lines(rows),
            currency=config.metering.currency,
            prices=dict(config.metering.prices),
        )

    @app.get(
        "/admin/status",
        operation_id="gateway_status",
        response_model=GatewayStatus,
        tags=["admin"],
        dependencies=[Depends(require_admin)],
    )
    async def gateway_status() -> dict:
        """The answering gateway replica's view: its store (kind, breaker, errors counted) and
        each pool's replicas. Each gateway replica keeps its own counts."""
        return await status()

    @app.get(
        "/admin/breakers",
        operation_id="describe_breakers",
        response_model=dict[str, BreakerView],
        tags=["admin"],
        responses=_errors(503),
        dependencies=[Depends(require_admin)],
    )
    async def describe_breakers() -> dict[str, dict]:
        """Every breaker the board knows (a closed one nobody failed may be absent)."""
        return await _on_board("describe", breakers.describe())

    @app.post(
        "/admin/breakers/reset",
        operation_id="reset_breakers",
        response_model=dict[str, BreakerView],
        tags=["admin"],
        responses=_errors(503),
        dependencies=[Depends(require_admin)],
    )
    async def reset_breakers(
        body: Annotated[BreakerReset | None, Body()] = None,
    ) -> dict[str, dict]:
        """Close one breaker, or every one; the board's breakers afterwards."""
        backend = body.backend if body else None
        if backend is not None and backend.split("/", 1)[0] not in backends:
            raise errors.invalid_request(
                f"No backend {backend!r}: name one of {', '.join(sorted(backends))}, or "
                "<pool>/<replica>; none resets every breaker.",
                param="backend",
            )
        return await _on_board("reset", breakers.reset(backend))

    @app.post(
        "/admin/faults",
        operation_id="inject_fault",
        response_model=FaultsSet,
        tags=["admin"],
        responses=_errors(400, 403, 404),
        dependencies=[Depends(require_admin)],
    )
    async def inject_fault(body: Annotated[FaultRequest, Body()]) -> FaultsSet:
        """Inject a fault on every replica of a pool (mode "none" clears it): what failover
        drills and the eval gate use, where the config turns it on (``faults.enabled``). Each
        replica's new fault, or null if it was not reached."""
        if not config.faults.enabled:
            raise errors.ForgeError(
                403,
                "Fault injection is off on this gateway (faults.enabled in its config).",
                type="permission_error",
                code="faults_disabled",
            )
        pool = pools.get(body.pool)
        if pool is None:
            raise errors.ForgeError(
                404,
                f"No pool named {body.pool!r}; pools: {sorted(pools)}.",
                type="invalid_request_error",
                code="pool_not_found",
                param="pool",
            )
        spec = body.fault.model_dump()
        replicas = await pool.set_fault(None if body.fault.mode == "none" else spec)
        logger.warning("admin: fault %s on pool %s (%d replicas)", spec, body.pool, len(replicas))
        return FaultsSet(pool=body.pool, replicas=replicas)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            app.openapi_schema = with_inference_routes(schema)
        return app.openapi_schema

    app.openapi = openapi
    app.state.admin_keys = AdminKeys.from_config(config, keyring)
    app.state.keyring = keyring
    app.state.auth_throttle = auth_throttle
    return app


async def _on_board(op: str, call: Awaitable[dict]) -> dict:
    """A board call's answer, or the 503 an unreachable board is (never a stack trace)."""
    try:
        return await call
    except Exception as exc:
        logger.warning("breaker board %s failed: %r", op, exc)
        raise errors.unavailable("Breaker board", "board_unavailable") from exc


def report_range(start: str | None, end: str | None) -> tuple[dt.date, dt.date]:
    """The report's first and last day (today UTC by default); a 400 naming the bad one."""
    today = dt.datetime.now(dt.UTC).date()
    first = parse_day(start, "start") if start is not None else today
    last = parse_day(end, "end") if end is not None else today
    try:
        date_range(first, last)
    except ValueError as exc:
        message = f"Invalid range: start {first}, end {last}: {exc}."
        raise errors.invalid_request(message, param="end" if last < first else "start") from exc
    return first, last


def parse_day(value: str, param: str) -> dt.date:
    try:
        if not _DAY_FORMAT.match(value):
            raise ValueError(value)
        return dt.date.fromisoformat(value)
    except ValueError:
        raise errors.invalid_request(
            f"Invalid {param} {value!r}: expected a date as YYYY-MM-DD.", param=param
        ) from None


def lines(rows: Iterable[UsageRow]) -> list[UsageLine]:
    return [UsageLine.model_validate(row.as_dict()) for row in rows]


# -- errors ----------------------------------------------------------------------------------


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's and FastAPI's own 404/405 (and any ``HTTPException``), OpenAI-shaped; in
    Anthropic's shape to an Anthropic client (``/v1/messages/batches``, ``GET /v1/messages``)."""
    headers = dict(exc.headers or {})  # a 405's Allow
    if exc.status_code == 405:
        err = errors.method_not_allowed(request.method, request.url.path)
    elif exc.status_code == 404:
        err = errors.not_found(request.url.path)
    else:
        err = errors.ForgeError(exc.status_code, str(exc.detail), type="invalid_request_error")
    if speaks_anthropic(request):
        body = anthropic_error(err.status, err.body()["error"], "")
        return Response(orjson.dumps(body), err.status, headers, media_type="application/json")
    return errors.error_response(err, headers)


async def _forge_error(request: Request, exc: errors.ForgeError) -> Response:
    return errors.error_response(exc)


async def _store_error(request: Request, exc: StoreError) -> Response:
    logger.warning("usage report failed: %r", exc)
    return errors.error_response(errors.unavailable("Usage store", "store_unavailable"))


async def _book_error(request: Request, exc: BookError) -> Response:
    logger.warning("usage report failed: %r", exc)
    return errors.error_response(errors.unavailable("Usage ledger", "ledger_unavailable"))


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    """FastAPI's 422 as the 400 the rest of the gateway answers, naming the parameter."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    where, *path = first.get("loc") or ("body",)
    if where == "body" and first.get("type") == "json_invalid":
        path = []
    param = ".".join(str(p) for p in path) or str(where)
    message = f"Invalid value for {param!r}: {first.get('msg')}."
    return errors.error_response(errors.invalid_request(message, param=param))
