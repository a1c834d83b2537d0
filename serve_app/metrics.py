"""Forge's metrics, on Ray's metrics path so they aggregate across replicas and nodes.

Every stage records through this one object; names follow the design card (``forge_*``; Ray's
exporter adds its ``ray_`` namespace in Prometheus). Tag values are strings, always all set.
``counter``/``gauge``/``histogram`` are how every other module declares its own series, so a
series is one line wherever it lives.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import TYPE_CHECKING

from ray.serve.metrics import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from serve_app.metering.ledger import UsageRecord
    from serve_app.resilience.breaker import State

_LATENCY_BUCKETS = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,  # a pool's default request_timeout_s: the longest answer is in a finite bucket
]


def counter(name: str, description: str, *tags: str) -> Counter:
    return Counter(name, description=description, tag_keys=tags)


def gauge(name: str, description: str, *tags: str) -> Gauge:
    return Gauge(name, description=description, tag_keys=tags)


def histogram(
    name: str, description: str, *tags: str, boundaries: list[float] | None = None
) -> Histogram:
    return Histogram(
        name, description=description, boundaries=boundaries or _LATENCY_BUCKETS, tag_keys=tags
    )


class ForgeMetrics:
    def __init__(self) -> None:
        # Status 499: the client left first, or its own deadline ended it; 599: a stream that
        # failed after its first byte (the client saw 200, then an SSE error event): a
        # truncation, counted apart as well.
        self.requests = counter(
            "forge_requests_total",
            "Requests by tenant, route, model, serving backend and HTTP status.",
            *("tenant", "route", "model", "backend", "status"),
        )
        self.ttft = histogram(
            "forge_ttft_seconds",
            "Time from request arrival to the first byte of a streamed answer.",
            *("route", "model", "backend"),
        )
        self.tpot = histogram(
            "forge_tpot_seconds",
            "Time per output token after the first, of streamed answers.",
            *("route", "model", "backend"),
        )
        self.duration = histogram(
            "forge_request_duration_seconds",
            "Time from request arrival to the end of the answer.",
            *("route", "model", "backend"),
        )
        # Traffic policy (``serve_app/traffic/``): a model's variants and the chain's spills.
        self.variant_requests = counter(
            "forge_variant_requests_total",
            "Requests to a models: entry by model, variant, the backend that answered and status.",
            *("model", "variant", "backend", "status"),
        )
        self.variant_ttft = histogram(
            "forge_variant_ttft_seconds",
            "Time to first byte of a models: entry's requests its variant's pool answered.",
            *("model", "variant"),
        )
        self.variant_tpot = histogram(
            "forge_variant_tpot_seconds",
            "Time per output token of a models: entry's streams its variant's pool answered.",
            *("model", "variant"),
        )
        self.spills = counter(
            "forge_spills_total",
            "Requests a model's chain sent on from a pool with no slot for them (its shed reason).",
            *("model", "source", "to", "reason"),
        )
        self.shadow_requests = counter(
            "forge_shadow_requests_total",
            "Shadow copies by model, pool and status (dropped: none started, at the cap).",
            *("model", "pool", "status"),
        )
        self.shadow_tokens = counter(
            "forge_shadow_tokens_total",
            "Tokens shadow copies used, by model, pool and kind: never a tenant's usage.",
            *("model", "pool", "kind"),
        )
        self.shadow_ttft = histogram(
            "forge_shadow_ttft_seconds",
            "Time to first byte of shadow copies.",
            *("model", "pool"),
        )
        self.config_changes = counter(
            "forge_config_changes_total",
            "Live configuration changes (the gateway's user_config) applied or refused.",
            "outcome",
        )
        self.truncated = counter(
            "forge_truncated_total",
            "Streams that ended in an error event after their first byte (not client leaves).",
            *("model", "backend"),
        )
        # Metering's counters: the same records the usage report is kept from.
        self.tokens = counter(
            "forge_tokens_total",
            "Tokens by tenant, model and kind: prompt and completion (the backends' usage) "
            "and cached (answered from the response cache).",
            *("tenant", "model", "kind"),
        )
        # The rest of a usage record (requests, errors, cached, fallback) is forge_requests_total
        # by status and backend already: only what that cannot say is counted again.
        self.estimated = counter(
            "forge_usage_estimated_total",
            "Requests charged the gateway's estimate because no backend reported usage.",
            *("tenant", "model"),
        )
        self.cache = counter(
            "forge_cache_requests_total",
            "Response cache lookups by model and result (hit, miss, bypass, error).",
            *("model", "result"),
        )
        self.cache_hits = counter(
            "forge_cache_hits_total",
            "Requests answered from the response cache, by tenant.",
            "tenant",
        )
        self.cache_stores = counter(
            "forge_cache_stores_total",
            "Answers offered to the cache, by result (stored, too_large, not_plain, error).",
            "result",
        )

        self.shed = counter(
            "forge_shed_total",
            "Requests refused to protect capacity, by tenant and reason.",
            *("tenant", "reason"),
        )
        self.store_errors = counter(
            "forge_store_errors_total",
            "Store calls that failed or were skipped (store known down), by op.",
            "op",
        )
        # The same count, readable in-process: GET /admin/status reports it, so a gate can see
        # a Redis loss was counted without a Prometheus to ask.
        self.store_errors_seen: Tally[str] = Tally()
        self.unmetered = counter(
            "forge_unmetered_total",
            "Requests served without a budget check because the store failed.",
            "tenant",
        )
        self.locally_metered = counter(
            "forge_local_budget_total",
            "Requests held to this gateway replica's share of their tenant's budgets because the "
            "store failed (the tenant's on_store_failure: local).",
            "tenant",
        )
        # By store: "main" (budgets, leases) and, where cache.store names one, "cache".
        self.store_state = gauge(
            "forge_store_breaker_state",
            "A store's breaker in this gateway: 0 closed, 1 probing, 2 skipped.",
            "store",
        )

        self.admitted = counter(
            "forge_admitted_total",
            "Requests granted a slot by fair admission, by tenant.",
            "tenant",
        )
        self.admission_errors = counter(
            "forge_admission_errors_total",
            "Scheduler calls that failed; the request was admitted (fail open).",
        )

        self.retries = counter(
            "forge_retries_total",
            "Second attempts before the first byte, by the backend retried on.",
            "backend",
        )
        self.retries_denied = counter(
            "forge_retries_denied_total",
            "Retries the retry budget refused (the client got the first failure).",
        )
        self.retry_budget = gauge(
            "forge_retry_budget_remaining",
            "Retries this gateway replica may still spend in the budget's window.",
        )
        self.backend_skipped = counter(
            "forge_backend_skipped_total",
            "Backends routed around without a try, by reason (breaker open, cold).",
            *("backend", "reason"),
        )
        self.board_errors = counter(
            "forge_breaker_board_errors_total",
            "Breaker board calls that failed; the last known states were used.",
            "op",
        )

    def record(
        self,
        *,
        tenant: str,
        route: str,
        model: str,
        backend: str,
        status: int,
        ttft_s: float | None,
        duration_s: float,
        usage: dict | None,
        streamed: bool = True,
    ) -> None:
        """One finished request. Its time to first token and per output token are a stream's
        only: a whole answer's first byte is its last (its time is the duration's), and its
        tokens came before it, so they would drag both the TTFT and TPOT panels off."""
        self.requests.inc(
            tags={
                "tenant": tenant,
                "route": route,
                "model": model,
                "backend": backend,
                "status": str(status),
            }
        )
        timing_tags = {"route": route, "model": model, "backend": backend}
        if ttft_s is not None and streamed:
            self.ttft.observe(ttft_s, tags=timing_tags)
        self.duration.observe(duration_s, tags=timing_tags)
        if status == 599:
            self.truncated.inc(tags={"model": model, "backend": backend})
        completion = _count(usage, "completion_tokens")
        if streamed and ttft_s is not None and completion > 1 and duration_s > ttft_s:
            self.tpot.observe((duration_s - ttft_s) / (completion - 1), tags=timing_tags)

    def store_changed(self, store: str, state: State) -> None:
        """A store's breaker moved (``store.build_stores`` names the store)."""
        self.store_state.set(int(state), tags={"store": store})

    def meter(self, record: UsageRecord) -> None:
        """A usage record's tokens by kind (prompt, completion, cached), and whether they were
        estimated; its request counts are forge_requests_total's (``record``)."""
        tags = {"tenant": record.tenant, "model": record.model}
        for name, value in record.counts.items():
            if value and name.endswith("_tokens"):
                self.tokens.inc(value, tags={**tags, "kind": name.removesuffix("_tokens")})
        if record.counts.get("estimated_requests"):
            self.estimated.inc(tags=tags)


def _count(usage: dict | None, field: str) -> int:
    """A token count from a backend's usage: data, not trusted (anything odd counts as 0)."""
    value = (usage or {}).get(field)
    return value if isinstance(value, int) and value > 0 else 0
