"""Forge's metrics, on Ray's metrics path so they aggregate across replicas and nodes.

Every stage records through this one object; names follow the design card (``forge_*``; Ray's
exporter adds its ``ray_`` namespace in Prometheus). Tag values are strings, always all set.
"""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

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
]


class ForgeMetrics:
    def __init__(self) -> None:
        self.requests = Counter(
            "forge_requests_total",
            description="Requests by tenant, route, serving backend and HTTP status.",
            tag_keys=("tenant", "route", "backend", "status"),
        )
        self.ttft = Histogram(
            "forge_ttft_seconds",
            description="Time from request arrival to the first byte of the answer.",
            boundaries=_LATENCY_BUCKETS,
            tag_keys=("route", "backend"),
        )
        self.duration = Histogram(
            "forge_request_duration_seconds",
            description="Time from request arrival to the end of the answer.",
            boundaries=_LATENCY_BUCKETS,
            tag_keys=("route", "backend"),
        )
        self.tokens = Counter(
            "forge_tokens_total",
            description="Tokens by tenant and kind (prompt, completion), from backend usage.",
            tag_keys=("tenant", "kind"),
        )

        self.shed = Counter(
            "forge_shed_total",
            description="Requests refused to protect capacity, by tenant and reason.",
            tag_keys=("tenant", "reason"),
        )
        self.store_errors = Counter(
            "forge_store_errors_total",
            description="Store calls that failed or were skipped (store known down), by op.",
            tag_keys=("op",),
        )
        self.unmetered = Counter(
            "forge_unmetered_total",
            description="Requests served without a budget check because the store failed.",
            tag_keys=("tenant",),
        )
        self.store_state = Gauge(
            "forge_store_breaker_state",
            description="The store's breaker in this gateway: 0 closed, 1 probing, 2 skipped.",
        )

        self.admitted = Counter(
            "forge_admitted_total",
            description="Requests granted a slot by fair admission, by tenant.",
            tag_keys=("tenant",),
        )
        self.admission_errors = Counter(
            "forge_admission_errors_total",
            description="Scheduler calls that failed; the request was admitted (fail open).",
        )

        self.retries = Counter(
            "forge_retries_total",
            description="Second attempts before the first byte, by the backend retried on.",
            tag_keys=("backend",),
        )
        self.retries_denied = Counter(
            "forge_retries_denied_total",
            description="Retries the retry budget refused (the client got the first failure).",
        )
        self.retry_budget = Gauge(
            "forge_retry_budget_remaining",
            description="Retries this gateway replica may still spend in the budget's window.",
        )
        self.backend_skipped = Counter(
            "forge_backend_skipped_total",
            description="Backends routed around without a try, by reason (breaker open, cold).",
            tag_keys=("backend", "reason"),
        )
        self.board_errors = Counter(
            "forge_breaker_board_errors_total",
            description="Breaker board calls that failed; the last known states were used.",
            tag_keys=("op",),
        )

    def record(
        self,
        *,
        tenant: str,
        route: str,
        backend: str,
        status: int,
        ttft_s: float | None,
        duration_s: float,
        usage: dict | None,
    ) -> None:
        self.requests.inc(
            tags={"tenant": tenant, "route": route, "backend": backend, "status": str(status)}
        )
        timing_tags = {"route": route, "backend": backend}
        if ttft_s is not None:
            self.ttft.observe(ttft_s, tags=timing_tags)
        self.duration.observe(duration_s, tags=timing_tags)
        if usage:
            for kind in ("prompt", "completion"):
                count = usage.get(f"{kind}_tokens")
                if isinstance(count, int) and count > 0:  # upstream usage is data, not trusted
                    self.tokens.inc(count, tags={"tenant": tenant, "kind": kind})
