"""Traffic policy's configuration: public model names over the pools (``models:``).

A model entry is what tenants call. It splits its traffic over *variants* (a pool each, by
weight: one variant is a plain alias, two are a canary), keeps each tenant, conversation or
request on one variant (``sticky``), spills along an ordered *chain* of other pools and the
external fallback when a step's conditions say so, and may mirror a share of its requests to a
*shadow* pool whose answers nobody sees. All of it is live (``user_config.models``): a canary's
weight goes 5 → 25 → 100 without replacing a replica. ``serve_app/traffic/`` serves it.
"""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from serve_app.config.base import NAME, Strict

# Why a chain moves on to its next step (each step lists those it is taken on, `when`):
#   breaker_open      the step before is open (or scaled to zero): routed around, no try spent;
#   overload          the step before had no slot within the model's overload_wait_s;
#   first_token_timeout, error   the step before failed before its first byte (a retry);
#   context_length    the prompt does not fit the step before's context window.
Condition = Literal["breaker_open", "overload", "first_token_timeout", "error", "context_length"]
CONDITIONS: tuple[Condition, ...] = (
    "breaker_open",
    "overload",
    "first_token_timeout",
    "error",
    "context_length",
)
FALLBACK = "fallback"  # a chain step naming the external fallback backend


class ChainStep(Strict):
    pool: Annotated[str, Field(pattern=NAME)]  # a pool's name, or "fallback"
    when: tuple[Condition, ...] = CONDITIONS  # not `on`: YAML reads that key as true

    @model_validator(mode="before")
    @classmethod
    def _on_read_as_true(cls, data: Any) -> Any:
        if isinstance(data, dict) and (True in data or "on" in data):
            raise ValueError(
                "a chain step's conditions go under 'when:' ('on:' is YAML's true, unquoted)"
            )
        return data


class Variant(Strict):
    name: Annotated[str, Field(pattern=NAME)]  # "stable", "canary", "v2": a metric label
    pool: Annotated[str, Field(pattern=NAME)]
    weight: Annotated[float, Field(ge=0, le=100)] = 100.0  # percent of the model's traffic
    # A LoRA adapter of the pool that serves this variant (``pools.adapters``): an alias of
    # an adapter, or a canary between an adapter's versions.
    adapter: Annotated[str, Field(pattern=NAME)] | None = None


class ShadowConfig(Strict):
    """A share of the model's requests sent again to ``pool``: its answer is discarded, its
    latency and errors recorded, its tokens metered apart (never charged to the tenant)."""

    pool: Annotated[str, Field(pattern=NAME)]
    percent: Annotated[float, Field(gt=0, le=100)]


class AnalysisConfig(Strict):
    """When the gateway sets a canary's weight to 0 by itself: once ``canary`` has served
    ``min_requests`` in the window and its error ratio exceeds the stable variant's by
    ``max_error_ratio_increase`` or its p95 time to first token is above ``max_ttft_ratio``
    times the stable one's. The abort holds until the model's config changes."""

    canary: Annotated[str, Field(pattern=NAME)]
    stable: Annotated[str, Field(pattern=NAME)]
    window_s: Annotated[float, Field(gt=0)] = 60.0
    min_requests: Annotated[int, Field(gt=0)] = 50
    max_error_ratio_increase: Annotated[float, Field(ge=0, le=1)] = 0.05
    max_ttft_ratio: Annotated[float, Field(gt=1)] = 1.5
    auto_abort: bool = True


class ModelPolicy(Strict):
    name: Annotated[str, Field(pattern=NAME)]  # the public model name tenants call
    variants: Annotated[list[Variant], Field(min_length=1)]
    # What keeps a caller on one variant: its tenant, its conversation (``x-forge-session``,
    # then OpenAI's ``user``, then the conversation's opening turn: the same through every
    # turn of it, ``previous_response_id`` included), or nothing (each request drawn anew).
    sticky: Literal["tenant", "conversation", "request"] = "tenant"
    # The steps after the variant's pool, in order. None: the pool's own (the fallback where
    # the pool allows it); [] for none at all.
    chain: list[ChainStep] | None = None
    # With a chain that spills on overload: how long a request may wait for the pool's slot
    # before it goes to the next step (0: only a free slot now; the pool's deadline otherwise).
    overload_wait_s: Annotated[float, Field(ge=0)] = 0.0
    shadow: ShadowConfig | None = None
    analysis: AnalysisConfig | None = None

    @model_validator(mode="after")
    def _split(self) -> ModelPolicy:
        names = [v.name for v in self.variants]
        dupes = sorted(n for n, c in Counter(names).items() if c > 1)
        if dupes:
            raise ValueError(f"variants: duplicate names {dupes}")
        total = sum(v.weight for v in self.variants)
        if abs(total - 100.0) > 1e-6:
            raise ValueError(f"variants: the weights sum to {total:g}, not 100")
        if self.analysis is not None:
            for role in ("canary", "stable"):
                if getattr(self.analysis, role) not in names:
                    raise ValueError(
                        f"analysis.{role}: no variant is named {getattr(self.analysis, role)!r}"
                    )
        return self

    def route_problems(
        self, where: str, pools: dict[str, str], fallback: bool, public: set[str]
    ) -> list[str]:
        """What this entry names that the rest of the config lacks (``pools``: name → task):
        each problem with its field's path. A cycle is a chain that comes back to a pool it
        has already tried."""
        problems = []
        if self.name in public:
            problems.append(f"{where}.name: {self.name!r} is a pool's model or another entry's")
        tasks = set()
        for i, variant in enumerate(self.variants):
            if variant.pool not in pools:
                problems.append(f"{where}.variants.{i}.pool: no pool is named {variant.pool!r}")
            else:
                tasks.add(pools[variant.pool])
        for i, step in enumerate(self.chain or []):
            if step.pool == FALLBACK:
                if not fallback:
                    problems.append(f"{where}.chain.{i}.pool: no fallback is configured")
                continue
            if step.pool not in pools:
                problems.append(f"{where}.chain.{i}.pool: no pool is named {step.pool!r}")
                continue
            tasks.add(pools[step.pool])
            earlier = [s.pool for s in (self.chain or [])[:i]]
            if step.pool in earlier or any(v.pool == step.pool for v in self.variants):
                problems.append(
                    f"{where}.chain.{i}.pool: {step.pool!r} comes back to a pool this model "
                    "already tried (a cycle)"
                )
        if self.shadow is not None:
            if self.shadow.pool not in pools:
                problems.append(f"{where}.shadow.pool: no pool is named {self.shadow.pool!r}")
            else:
                tasks.add(pools[self.shadow.pool])
        if len(tasks) > 1:
            problems.append(f"{where}: its pools do not all do one task ({sorted(tasks)})")
        return problems
