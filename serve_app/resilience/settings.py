"""From validated config to the pure state machines' settings (which know nothing of pydantic)."""

from __future__ import annotations

from serve_app.config import BreakerConfig, RetryBudgetConfig
from serve_app.resilience.breaker import BreakerSettings
from serve_app.resilience.retry_budget import RetryBudgetSettings


def breaker_settings(config: BreakerConfig) -> BreakerSettings:
    return BreakerSettings(**config.model_dump())


def retry_budget_settings(config: RetryBudgetConfig) -> RetryBudgetSettings:
    return RetryBudgetSettings(**config.model_dump())
