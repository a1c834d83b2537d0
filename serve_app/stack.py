"""The one place that lists the request path, in order, as Starlette's ``build_middleware_stack``.

``build_pipeline`` returns the ordered stages of an inference request and composes them around
dispatch; ``/v1/models`` and ``GET``/``DELETE /v1/responses/{id}`` reuse the same first stages
(request id, telemetry, auth), and ``/v1/messages/count_tokens`` those and parse, rather than a
second hand-written list. The order is DESIGN.md's, and each position has a reason (with
tracing on, a root span opens before all of them, ``stages/trace.py``):

1. request id: every log line, backend call and response carries it;
2. telemetry, right after it: every outcome, a 401 included, is logged and counted once;
3. auth: anonymous traffic costs a hash and never touches the store;
4. metering: it records when the response ends, what dispatch or the cache answered (the
   design's last step), and sits here so a tenant's 400s and 429s are counted too;
5. parse: the body is read under its limit and validated only for a known tenant;
6. quota: a tenant out of budget is out even for an answer that would be cached;
7. cache: a hit costs no slot and no backend;
8. fair admission: a slot of the pool, only for requests that will reach it;
9. dispatch: a backend past its breaker, one retry before the first byte; its ``usage`` settles
   the quota and is metered when the response ends.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from opentelemetry.trace import Tracer

from serve_app.admission.client import SchedulerClient
from serve_app.admission.scheduler import tenant_cap
from serve_app.admission.warm_slots import WarmSlots
from serve_app.auth.keys import KeyRing
from serve_app.auth.throttle import FailedAuthThrottle
from serve_app.backends.base import Backend
from serve_app.config.models import AdmissionConfig, ForgeConfig, PoolConfig
from serve_app.dialects import Dialect, MessagesDialect, ResponsesDialect, StoredResponses
from serve_app.dialects.base import count_tokens
from serve_app.metering.book import UsageBook
from serve_app.metering.journal import JournalError
from serve_app.metering.ledger import UsageLedger, build_book, build_journal
from serve_app.metrics import ForgeMetrics
from serve_app.pipeline import Handler, Stage, compose, traced_endpoint
from serve_app.resilience.client import BreakerClient
from serve_app.resilience.retry_budget import RetryBudget
from serve_app.resilience.settings import retry_budget_settings
from serve_app.stages.admission import AdmissionStage
from serve_app.stages.authenticate import AuthStage
from serve_app.stages.cache import CachedPool, CacheStage
from serve_app.stages.counting_limit import CountingLimit
from serve_app.stages.dispatch import Dispatch
from serve_app.stages.metering import MeterStage
from serve_app.stages.parse import ParseStage
from serve_app.stages.quota import QuotaStage
from serve_app.stages.request_id import RequestIdStage
from serve_app.stages.settles import Settles
from serve_app.stages.store_failures import StoreFailures
from serve_app.stages.telemetry import TelemetryStage
from serve_app.stages.trace import TraceStage
from serve_app.store import Store
from serve_app.traffic.policy import TrafficPolicy
from serve_app.traffic.shadow import Shadows
from serve_app.traffic.watch import TrafficWatch

S = TypeVar("S", bound=Stage)

RENEWAL_SLACK_S = 60.0


@dataclass(frozen=True, slots=True)
class Collaborators:
    """Everything outside the gateway that the stack talks to. ``gateway/ingress.py`` builds
    them over Serve handles, ``serve_app/local.py`` in process."""

    keyring: KeyRing
    store: Store
    metrics: ForgeMetrics
    backends: Mapping[str, Backend]  # pool name (or "fallback") → backend
    schedulers: Mapping[str, SchedulerClient]  # pool name → its scheduler (admission pools)
    breakers: BreakerClient
    tracer: Tracer | None = None  # None: nothing traced, nothing added to the path
    # Settles (refunds, lease releases), off the request path: the store with a patient
    # timeout (None: ``store`` itself, as the embedded store is).
    usage_store: Store | None = None
    # The durable usage ledger (None: the one the config names, ``metering.ledger.build_book``).
    book: UsageBook | None = None
    # Cached answers, when ``cache.store`` gives them a Redis apart from the budgets' (None:
    # ``store``): the cache may be evicted or lost, a budget never.
    cache_store: Store | None = None


@dataclass(frozen=True, slots=True)
class LastingParts:
    """What a gateway replica keeps across live rebuilds of its pipeline: the usage queued for
    the ledger, the settles still landing, the failed-auth counts, and the pool slots it holds
    (parked or in use). A live
    configuration change builds a new pipeline around these same objects, so nothing queued,
    counted or held is dropped; ``build_lasting`` makes them once per replica."""

    ledger: UsageLedger
    settles: Settles  # refunds and lease releases, retried until the store confirms them
    auth_throttle: FailedAuthThrottle | None
    slots: Mapping[str, WarmSlots]  # pool name → this replica's slots of it (admission pools)
    watch: TrafficWatch  # each model variant's window, and the canaries aborted
    shadows: Shadows  # the shadow copies still running

    def retune(self, config: ForgeConfig) -> None:
        """A live change's per-tenant cap and keep-warm for the slots already held, and its
        models: entries (an entry that changed starts its window over, its abort lifted)."""
        self.watch.retune(config.models)
        for pool in config.pools:
            slots = self.slots.get(pool.name)
            if slots is not None and pool.admission is not None:
                slots.tenant_cap = tenant_cap(
                    pool.admission.max_inflight, pool.admission.max_tenant_share
                )
                slots.keep_warm_s = pool.admission.keep_warm_s


def build_lasting(config: ForgeConfig, parts: Collaborators) -> LastingParts:
    """The parts that outlive a live rebuild, built once per gateway replica."""
    store_failed = StoreFailures(parts.metrics, "usage kept queued, retried")
    # A journal for the ledger the config names (a book passed in is a test's own).
    journal = build_journal(config.metering) if parts.book is None else None
    ledger = UsageLedger(
        parts.book if parts.book is not None else build_book(config.metering),
        flush_s=config.metering.flush_s,
        on_error=lambda exc: store_failed(
            "journal" if isinstance(exc, JournalError) else "meter", exc
        ),
        journal=journal,
    )
    throttle = None
    if config.gateway.auth_throttle is not None:
        shed = parts.metrics.shed
        throttle = FailedAuthThrottle(
            config.gateway.auth_throttle,
            lambda: shed.inc(tags={"tenant": "anonymous", "reason": "auth_throttle"}),
        )
    slots = {
        p.name: warm_slots(parts.schedulers[p.name], p.admission) for p in _admitted(config, parts)
    }
    settles = Settles(StoreFailures(parts.metrics, "retried until it lands"))
    watch = TrafficWatch()
    watch.retune(config.models)
    shadows = Shadows(parts.backends, parts.metrics)
    return LastingParts(ledger, settles, throttle, slots, watch, shadows)


def _admitted(config: ForgeConfig, parts: Collaborators) -> list[PoolConfig]:
    return [p for p in config.pools if p.admission is not None and p.name in parts.schedulers]


@dataclass(frozen=True, slots=True)
class Pipeline:
    inference: Handler  # /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages
    listing: Handler  # /v1/models
    stages: tuple[Stage, ...]  # the inference stages, in order (for docs, tests and traces)
    dialects: Mapping[str, Dialect]  # "responses", "messages": they answer in their own shape
    stored_response: Handler  # GET and DELETE /v1/responses/{id}
    # /v1/messages/count_tokens, /v1/responses/input_tokens: the body read, translated, counted
    count_tokens: Handler
    dispatch: Dispatch  # the last step (its retry budget is read between requests too)

    def stage(self, kind: type[S]) -> S:
        """The one stage of type ``kind``: found by what it is, never by where it sits."""
        found = [s for s in self.stages if isinstance(s, kind)]
        if len(found) != 1:
            raise LookupError(f"{len(found)} stages of type {kind.__name__} in the pipeline")
        return found[0]


def build_pipeline(
    config: ForgeConfig,
    parts: Collaborators,
    lasting: LastingParts,
    *,
    list_models: Handler,
) -> Pipeline:
    """The request path around ``lasting`` (built once, kept across rebuilds), with ``config``'s
    traffic policy (``traffic/policy.py``: where each served name leads); with
    ``parts.tracer``, a root span first and a span per stage."""
    metrics, tracer = parts.metrics, parts.tracer
    policy = TrafficPolicy(config, lasting.watch)
    front: list[Stage] = [
        RequestIdStage(),
        TelemetryStage(metrics, lasting.watch),
        AuthStage(parts.keyring, lasting.auth_throttle),
    ]
    responses = ResponsesDialect(
        StoredResponses(
            parts.cache_store if parts.cache_store is not None else parts.store,
            ttl_s=config.responses.stored_ttl_s,
            max_bytes=config.responses.max_stored_bytes,
            on_error=StoreFailures(metrics, "a stored response is not kept or not read"),
        )
    )
    dialects: dict[str, Dialect] = {"responses": responses, "messages": MessagesDialect()}
    parse = ParseStage(config.gateway, policy, dialects)
    admitted = _admitted(config, parts)
    # How long a request may hold a lease or a slot at most: its total deadline, then the
    # abandoned-usage question and a retry's slack. Renewers stop there, whatever happened.
    lifetimes = {p.model: p.request_timeout_s + RENEWAL_SLACK_S for p in config.pools}
    stages: list[Stage] = [
        *front,
        MeterStage(lasting.ledger if config.metering.enabled else None, metrics),
        parse,
        QuotaStage(
            parts.store,
            metrics,
            config.tenants,
            {p.model: p.default_max_tokens for p in config.pools},
            lasting.settles,
            parts.usage_store,  # patient: a settle is off the request path
            lifetimes,
            1 / gateway_replicas(config),
        ),
        *cache_stage(config, parts),
        AdmissionStage(
            {p.model: lasting.slots[p.name] for p in admitted},
            {p.model: p.admission.deadline_s for p in admitted},
            metrics,
            lifetimes,
        ),
    ]
    dispatch = Dispatch(
        {
            route: [parts.backends[s.backend] for s in steps]
            for route, steps in policy.routes.items()
        },
        parts.breakers,
        RetryBudget(retry_budget_settings(config.resilience.retry_budget)),
        metrics,
        conditions={route: [s.on for s in steps] for route, steps in policy.routes.items()},
        served={p.name: p.model for p in config.pools},
        shadows=lasting.shadows,
    )
    # Counting spends no tokens, but CPU: at the tenant's requests/min, apart (its own module).
    counting = [*front, CountingLimit(config.tenants, 1 / gateway_replicas(config)), parse]
    if tracer is None:
        return Pipeline(
            compose(stages, dispatch),
            compose(front, list_models),
            tuple(stages),
            dialects,
            compose(front, responses.stored_response),
            compose(counting, count_tokens),
            dispatch,
        )
    # Traced: the root span opens first, then a span per stage, and dispatch's own.
    root = TraceStage(tracer)
    inference = compose(stages, traced_endpoint(dispatch, tracer, "forge.dispatch"), tracer)
    return Pipeline(
        compose([root], inference),
        compose([root], compose(front, list_models, tracer)),
        tuple(stages),
        dialects,
        compose([root], compose(front, responses.stored_response, tracer)),
        compose([root], compose(counting, count_tokens, tracer)),
        dispatch,
    )


def gateway_replicas(config: ForgeConfig) -> int:
    """How many gateway replicas share the budgets, as far as the config says: each one's
    share while the store is unreachable (the most an autoscaled deployment may run, so the
    shares never add up to more than the limit)."""
    deployment = config.gateway.deployment
    autoscaling = deployment.get("autoscaling_config") or {}
    return max(1, int(autoscaling.get("max_replicas") or deployment.get("num_replicas") or 1))


def cache_stage(config: ForgeConfig, parts: Collaborators) -> list[Stage]:
    """The response cache, when on, for the generation pools' models (embeddings bypass it:
    an entry holds one completion's text), in the cache's own store where it has one."""
    if not config.cache.enabled:
        return []
    pools = {
        p.model: CachedPool(p.name, _engine_identity(p, parts.backends[p.name]))
        for p in config.pools
        if p.task == "generate"
    }
    store = parts.cache_store if parts.cache_store is not None else parts.store
    return [CacheStage(store, parts.metrics, config.cache, pools)]


def _engine_identity(pool: PoolConfig, backend: Backend) -> Callable[[], str | None]:
    if pool.app is None:  # the gateway's own application: the config is what runs
        identity = pool.engine_identity()
        return lambda: identity
    control = backend.pool
    return control.engine_identity if control is not None else lambda: None


def warm_slots(client: SchedulerClient, admission: AdmissionConfig) -> WarmSlots:
    """This replica's view of a pool's slots, with the scheduler's own per-tenant cap."""
    cap = tenant_cap(admission.max_inflight, admission.max_tenant_share)
    return WarmSlots(client, tenant_cap=cap, keep_warm_s=admission.keep_warm_s)
