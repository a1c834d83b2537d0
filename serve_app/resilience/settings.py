"""From validated config to the pure state machines' settings (which know nothing of pydantic)."""

from __future__ import annotations

from serve_app.config.models import BreakerConfig, ResilienceConfig, RetryBudgetConfig
from serve_app.resilience.breaker import BreakerSettings
from serve_app.resilience.retry_budget import RetryBudgetSettings


def breaker_settings(config: BreakerConfig) -> BreakerSettings:
    return BreakerSettings(**config.model_dump())


def retry_budget_settings(config: RetryBudgetConfig) -> RetryBudgetSettings:
    return RetryBudgetSettings(**config.model_dump())


def breaker_client_options(config: ResilienceConfig) -> dict:
    """A gateway replica opens its own copy of a breaker on the failures that open the board's,
    for as long as the board's would stay open."""
    return {
        "trip_after": config.breaker.failure_threshold,
        "local_open_s": config.breaker.cooldown_s,
    }
