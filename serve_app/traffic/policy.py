"""A request's model name, resolved to the steps that may serve it.

Every served name has a *route*: its steps in order. A pool's own model is the pool, then the
fallback where the pool allows it (Forge's behaviour before traffic policy, kept). A
``models:`` entry has a route per variant: the variant's pool, then its chain. ``resolve``
picks the variant: from a point on [0, 100) that the sticky key hashes to, so a tenant (or a
conversation) stays on one variant while the weights stay, and a canary raised from 10 to 50
keeps everyone it had (the canary listed last holds the top of the range). Variants an
analysis aborted weigh 0 until the entry changes.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

import orjson

from serve_app import errors
from serve_app.adapters import adapter_model
from serve_app.config.models import AdapterConfig, ForgeConfig, PoolConfig, TenantConfig
from serve_app.config.traffic import CONDITIONS, FALLBACK, ModelPolicy, ShadowConfig
from serve_app.traffic.watch import TrafficWatch

SESSION_HEADER = "x-forge-session"
VARIANT_HEADER = "x-forge-variant"
ALL_CONDITIONS = frozenset(CONDITIONS)


@dataclass(frozen=True, slots=True)
class Step:
    """One backend of a route and what may send a request on to it."""

    backend: str  # a pool's name, or "fallback"
    model: str | None  # the pool's model (None: the fallback)
    on: frozenset[str] = ALL_CONDITIONS  # conditions on the step before that take this one
    context: int | None = None  # the pool's context window, where routed by
    default_max_tokens: int = 256  # the pool's, for a request that names none


@dataclass(frozen=True, slots=True)
class Target:
    """What a request resolved to: its route's key and steps, and the variant it is on."""

    model: str  # the name asked for
    route: str  # dispatch's key for the steps
    steps: tuple[Step, ...]
    variant: str | None = None  # set for a ``models:`` entry
    shadow: ShadowConfig | None = None  # set when this request is also mirrored
    overload_wait_s: float = 0.0
    start: int = 0  # the step the request starts on (a long prompt, a spill, move it on)
    # Steps it may not take: their context window does not fit it, or (an adapter's request)
    # they lack its adapter: other pools, and the fallback, whose answer would be the base's.
    excluded: frozenset[str] = frozenset()
    adapter: str | None = None  # the LoRA adapter of the route's own pool that serves it

    @property
    def pool_model(self) -> str | None:
        """The model of the step the request starts on: what quota, the cache and admission
        key by (None: it starts on the fallback)."""
        return self.steps[self.start].model if self.steps else None


@dataclass(frozen=True, slots=True)
class _Entry:
    policy: ModelPolicy
    routes: tuple[str, ...]  # per variant, in order


class TrafficPolicy:
    def __init__(self, config: ForgeConfig, watch: TrafficWatch | None = None) -> None:
        """``watch``: whose ``aborted`` (model, variant) pairs weigh 0 (``watch.py``)."""
        pools = {p.name: p for p in config.pools}
        # Each pool's context window, where its config says it (None: the model's own).
        self.windows = {p.name: p.context_limit() for p in config.pools}
        fallback = config.fallback is not None
        self.routes: dict[str, tuple[Step, ...]] = {}
        for pool in config.pools:
            steps = [Step(pool.name, pool.model)]
            if fallback and pool.fallback:
                steps.append(Step(FALLBACK, None))
            self.routes[pool.model] = tuple(steps)
        if config.fallback is not None:
            self.routes.setdefault(config.fallback.model, (Step(FALLBACK, None),))
        # "<model>:<adapter>" → the pool's model and the adapter: the pool's own route.
        self.adapters: dict[str, tuple[str, AdapterConfig]] = {}
        self.pool_adapters = {p.name: frozenset(a.name for a in p.adapters) for p in config.pools}
        for pool in config.pools:
            for adapter in pool.adapters:
                name = adapter_model(pool.model, adapter.name)
                self.routes[name] = self.routes[pool.model]
                self.adapters[name] = (pool.model, adapter)
        self.entries: dict[str, _Entry] = {}
        for policy in config.models:
            keys = []
            for variant in policy.variants:
                pool = pools[variant.pool]
                steps = [_step(pool, ALL_CONDITIONS)]
                if policy.chain is None:
                    steps += self.routes[pool.model][1:]
                for step in policy.chain or []:
                    if step.pool == FALLBACK:
                        steps.append(Step(FALLBACK, None, frozenset(step.when)))
                    else:
                        steps.append(_step(pools[step.pool], frozenset(step.when)))
                key = f"{policy.name}@{variant.name}"
                self.routes[key] = tuple(steps)
                keys.append(key)
            self.entries[policy.name] = _Entry(policy, tuple(keys))
        self.names = [p.model for p in config.pools]
        if config.fallback is not None and config.fallback.model not in self.names:
            self.names.append(config.fallback.model)
        self.names += list(self.entries)
        self.watch = watch
        self._version = -1
        self._bounds: dict[str, list[tuple[float, int]]] = {}
        self._weigh()
        # Served name → what it does ("generate" or "embed"); the fallback's model generates.
        self.tasks = {name: "generate" for name in self.names}
        self.tasks.update({p.model: p.task for p in config.pools})
        for name, entry in self.entries.items():
            self.tasks[name] = pools[entry.policy.variants[0].pool].task
        self.tasks.update({name: "generate" for name in self.adapters})

    def _weigh(self) -> None:
        """Each variant's upper bound on [0, 100), aborted ones weighing 0 (their share goes to
        the others, in proportion); again whenever the watch aborts one."""
        aborted = self.watch.aborted if self.watch is not None else set()
        self._version = self.watch.version if self.watch is not None else 0
        self._bounds = {name: _cumulative(entry, aborted) for name, entry in self.entries.items()}

    def policy(self, model: str) -> ModelPolicy | None:

        entry = self.entries.get(model)
        return None if entry is None else entry.policy

    def may_call(self, tenant: TenantConfig | None, model: str) -> bool:
        """Whether ``tenant`` may call the served name ``model``: its allow-list (None: every
        name), and for an adapter's name also the adapter's own tenants. An allow-list names
        an adapter itself (``<model>:<adapter>``; its model's name is not enough: an adapter is
        someone's fine-tune); a tenant bound to an adapter may always call it."""
        if tenant is None:
            return True
        allowed = tenant.models
        found = self.adapters.get(model)
        if found is None:
            return allowed is None or model in allowed
        base, adapter = found
        if tenant.adapters.get(base) == adapter.name:
            return True
        if adapter.tenants is not None and tenant.name not in adapter.tenants:
            return False
        return allowed is None or model in allowed

    def window(self, steps: Collection[Step]) -> int | None:
        """The context window a request on ``steps`` can count on: the smallest of their pools'
        (the fallback's is its own, larger); None where a pool's is not in its config."""
        windows = [self.windows.get(s.backend) for s in steps if s.model is not None]
        if not windows or None in windows:
            return None
        return min(w for w in windows if w is not None)

    def served_window(self, model: str) -> int | None:
        """The context window of a served name: over every variant of a ``models:`` entry."""
        entry = self.entries.get(model)
        routes = entry.routes if entry is not None else (model,)
        return self.window([s for r in routes for s in self.routes.get(r, ())])

    def listed(self, tenant: TenantConfig | None) -> list[str]:
        """What ``/v1/models`` lists to ``tenant``: the names it may call, adapters included."""
        return [m for m in [*self.names, *self.adapters] if self.may_call(tenant, m)]

    def bind(self, target: Target, tenant: TenantConfig | None) -> Target:
        """``target`` with its adapter: the one its name or variant names, else the one
        ``tenant`` is bound to for the route's pool (``tenants.adapters``). The steps that lack
        the adapter are left out (a 404 when a variant's adapter is not the tenant's to call)."""
        base = target.steps[0].model if target.steps else None
        adapter = target.adapter
        if base is None:
            return target
        if adapter is None:
            adapter = tenant.adapters.get(base) if tenant is not None else None
            if adapter is None:
                return target
        elif target.variant is not None and not self.may_call(tenant, adapter_model(base, adapter)):
            raise errors.model_not_found(target.model)  # told as if it did not exist
        lacking = {
            s.backend for s in target.steps if adapter not in self.pool_adapters.get(s.backend, ())
        }
        excluded = target.excluded | lacking
        steps = range(target.start, len(target.steps))
        start = next((i for i in steps if target.steps[i].backend not in excluded), target.start)
        return replace(target, adapter=adapter, excluded=frozenset(excluded), start=start)

    def resolve(self, model: str, tenant: str, body: Mapping | None, headers: Mapping) -> Target:
        """The route ``model`` takes for this request (``model`` must be a served name)."""
        entry = self.entries.get(model)
        if entry is None:
            found = self.adapters.get(model)
            adapter = found[1].name if found is not None else None
            return Target(model, model, self.routes[model], adapter=adapter)
        if self.watch is not None and self.watch.version != self._version:
            self._weigh()
        policy = entry.policy
        point = _point(model, _sticky_key(policy.sticky, tenant, body, headers))
        index = next((i for upper, i in self._bounds[model] if point < upper), None)
        if index is None:  # the top of the range, by float rounding
            index = self._bounds[model][-1][1]
        shadow = policy.shadow
        if shadow is not None and random.random() * 100.0 >= shadow.percent:
            shadow = None
        return self._variant(model, entry, index, shadow)

    def _variant(
        self, model: str, entry: _Entry, index: int, shadow: ShadowConfig | None = None
    ) -> Target:
        policy, route = entry.policy, entry.routes[index]
        return Target(
            model,
            route,
            self.routes[route],
            policy.variants[index].name,
            shadow,
            policy.overload_wait_s,
            adapter=policy.variants[index].adapter,
        )

    def other_variants(self, target: Target) -> list[Target]:
        """The variants of ``target``'s model besides its own that take traffic now, heaviest
        first: where a request is too long for the one its key chose (a canary on a pool with
        a smaller window), one that takes it serves it, rather than a 400."""
        entry = self.entries.get(target.model)
        if entry is None or target.variant is None:
            return []
        live = {i for _, i in self._bounds[target.model]}
        variants = entry.policy.variants
        order = sorted(live, key=lambda i: -variants[i].weight)
        return [
            self._variant(target.model, entry, i)
            for i in order
            if variants[i].name != target.variant
        ]


def _cumulative(entry: _Entry, aborted: Collection[tuple[str, str]]) -> list[tuple[float, int]]:
    weights = [
        0.0 if (entry.policy.name, v.name) in aborted else v.weight for v in entry.policy.variants
    ]
    if not any(weights):  # every variant aborted: weigh them as written rather than serve none
        weights = [v.weight for v in entry.policy.variants]
    total = sum(weights)
    bounds, upper = [], 0.0
    for i, weight in enumerate(weights):
        upper += weight * 100.0 / total
        if weight > 0:
            bounds.append((upper, i))
    return bounds


def place(
    target: Target, prompt_tokens: int, max_tokens: int | None, *, truncated: bool = False
) -> Target:
    """The step a request of this length starts on: the first whose context window takes
    prompt and completion (past the first, only a step taken on ``context_length``); steps too
    small are left out of its retries too. Where no step takes both, the first that takes the
    prompt, whose engine cuts the answer to what its window leaves (as vLLM does). Where none
    takes the prompt, a 400; or, for a conversation its replica may truncate
    (``engines/truncation.py``), the route's first step, as if it fit."""
    if all(step.context is None for step in target.steps):
        return target
    placed = _placed(target, lambda step: prompt_tokens + (max_tokens or step.default_max_tokens))
    if placed is None:
        placed = _placed(target, lambda step: prompt_tokens + 1)
    if placed is None and truncated:
        placed = _placed(target, lambda step: 1)
    if placed is None:
        needed = prompt_tokens + (max_tokens or target.steps[0].default_max_tokens)
        largest = max(step.context or 0 for step in target.steps)
        raise errors.context_length_exceeded(target.model, needed, largest)
    start, excluded = placed
    if start == target.start and not excluded:
        return target
    return replace(target, start=start, excluded=frozenset(excluded))


def _placed(target: Target, needs: Callable[[Step], int]) -> tuple[int, set[str]] | None:
    """The first step whose window takes what ``needs`` says, and the steps too small."""
    excluded, start = set(), None
    for i, step in enumerate(target.steps):
        if step.context is not None and needs(step) > step.context:
            excluded.add(step.backend)
            continue
        if start is None and (i == 0 or "context_length" in step.on):
            start = i
    return None if start is None else (start, excluded)


def _step(pool: PoolConfig, on: frozenset[str]) -> Step:
    return Step(pool.name, pool.model, on, pool.context_limit(), pool.default_max_tokens)


def _sticky_key(sticky: str, tenant: str, body: Mapping | None, headers: Mapping) -> str | None:
    """What keeps a caller on its variant; None: nothing (each request drawn anew)."""
    if sticky == "tenant":
        return "t:" + tenant
    if sticky == "conversation":
        session = headers.get(SESSION_HEADER)
        if session:
            return f"s:{tenant}:{session}"
        user = (body or {}).get("user")
        if isinstance(user, str) and user:
            return f"u:{tenant}:{user}"
        opening = _opening(body or {})
        if opening is not None:
            return f"o:{tenant}:" + opening
    return None


def _opening(body: Mapping) -> str | None:
    """The conversation's first turn that is not a system prompt: the same in every request of
    it (a chat client resends the history; a Responses follow-up has it restored)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, Mapping) and message.get("role") not in ("system", "developer"):
                return orjson.dumps(message.get("content"), option=orjson.OPT_SORT_KEYS).decode()
        return None
    prompt = body.get("prompt")
    return prompt[:512] if isinstance(prompt, str) else None


def _point(model: str, key: str | None) -> float:
    """Where ``key`` falls on [0, 100), the same in every gateway replica and process."""
    if key is None:
        return random.random() * 100.0
    digest = hashlib.blake2b(f"{model}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 * 100.0
