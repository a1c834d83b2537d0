"""The part of Forge's configuration that changes without restarting anything.

Ray Serve versions every deployment of an application by the application's ``args``: change
one field there and every deployment of it (gateway, schedulers, breaker board, and any pool
that runs in it rather than in its own application: ``PoolConfig.app``) is replaced.
A deployment's ``user_config`` is different: Serve hands a changed one to the running replicas
(``reconfigure``) and replaces none. So what operators change daily lives in the gateway
deployment's ``user_config`` in the Serve config file::

    applications:
      - name: forge
        args: {...}                  # structure: pools, store, fallback, gateway limits
        deployments:
          - name: gateway
            user_config:             # live: tenants, keys, limits, weights, tiers, ...
              tenants: [...]
              admin: {key_hashes: [...]}
              admission: {primary: {max_inflight: 16}}
              resilience: {breaker: {cooldown_s: 10}}
              models: [{name: chat, variants: [...]}]   # aliases, canaries, chains

Each key replaces the args' value of the same name whole (``admission`` replaces the admission
section of the pools it names). The merged configuration is validated by the same models as
the args (``ForgeConfig``); an error names the field's path. The gateway applies a valid change
atomically (``Gateway.apply``) and passes the schedulers' and the breaker board's part on; it
refuses an invalid one and keeps serving the configuration it had (``gateway/ingress.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from serve_app.config.digest import settings_digest
from serve_app.config.models import (
    POOL_APP_FIELDS,
    POOL_SHARED_FIELDS,
    AdminConfig,
    AdmissionConfig,
    ConfigError,
    ForgeConfig,
    ResilienceConfig,
    TenantConfig,
    _Strict,
    load_config,
    load_control_app_config,
    load_pool_app_config,
)
from serve_app.config.traffic import ModelPolicy


class LiveConfig(_Strict):
    """What the gateway's ``user_config`` may hold; every key optional."""

    tenants: list[TenantConfig] | None = None
    admin: AdminConfig | None = None
    admission: dict[str, AdmissionConfig] | None = None  # pool name → its admission section
    resilience: ResilienceConfig | None = None
    models: list[ModelPolicy] | None = None  # replaces the args' list whole


LIVE_KEYS = tuple(LiveConfig.model_fields)
GATEWAY_DEPLOYMENT = "gateway"  # serve_app/app.py names the ingress deployment so


def apply_live(base: ForgeConfig, user_config: Mapping[str, Any] | None) -> ForgeConfig:
    """``base`` (from the args) with ``user_config``'s sections in place; ``ConfigError`` naming
    each bad field (``tenants.2.limits.rpm``, ``admission.primary.max_inflight``) otherwise."""
    if not user_config:
        return base
    if not isinstance(user_config, Mapping):
        raise ConfigError("invalid live config: user_config must be a mapping")
    unknown = sorted(set(user_config) - set(LIVE_KEYS))
    if unknown:
        raise ConfigError(
            "invalid live config (the gateway's user_config):\n"
            + "\n".join(
                f"  {key}: not a live setting (those are {', '.join(LIVE_KEYS)}); set it in "
                "the application's args, which redeploys the application"
                for key in unknown
            )
        )
    try:
        live = LiveConfig.model_validate(dict(user_config))
    except ValidationError as exc:
        raise _config_error("invalid live config (the gateway's user_config)", exc) from None
    # What the args gave (a pool that runs in its own application lists no engine here).
    data, given = base.model_dump(exclude_unset=True), live.model_dump(exclude_unset=True)
    for key in ("tenants", "admin", "resilience", "models"):
        if key in given:
            data[key] = given[key]
    problems = []
    pools = {model.name: pool for model, pool in zip(base.pools, data["pools"], strict=True)}
    for name, admission in (live.admission or {}).items():
        pool = pools.get(name)
        if pool is None:
            problems.append(f"  admission.{name}: no pool is named {name!r} ({sorted(pools)})")
        elif pool.get("admission") is None:
            problems.append(
                f"  admission.{name}: pool {name!r} has no admission in the args (no scheduler "
                "runs for it); add the section there, which redeploys the application"
            )
        else:
            pool["admission"] = admission.model_dump()
    if problems:
        title = "invalid live config (the gateway's user_config):\n"
        raise ConfigError(title + "\n".join(problems))
    config = load_config(data)  # the cross-field checks: unique names, keys, shared store
    if not config.tenants:
        raise ConfigError("invalid live config: tenants: at least one tenant is needed")
    return config


def live_digest(config: ForgeConfig) -> str:
    """Names the live part of a configuration (in ``/admin/status`` and the logs)."""
    return settings_digest(
        [t.model_dump() for t in config.tenants],
        config.admin.model_dump(),
        {p.name: p.admission.model_dump() for p in config.pools if p.admission is not None},
        config.resilience.model_dump(),
        [m.model_dump() for m in config.models],
    )


def _config_error(title: str, exc: ValidationError) -> ConfigError:
    lines = [
        f"  {'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
        for e in exc.errors(include_url=False)
    ]
    return ConfigError(f"{title}:\n" + "\n".join(lines))


def gateway_user_config(application: Mapping[str, Any]) -> dict | None:
    """The gateway deployment's ``user_config`` in one application of a Serve config file."""
    for deployment in application.get("deployments") or []:
        if deployment.get("name") == GATEWAY_DEPLOYMENT:
            return deployment.get("user_config")
    return None


def application_config(application: Mapping[str, Any]) -> ForgeConfig:
    """The configuration a gateway of this Serve application serves: its ``args`` with its
    gateway's ``user_config`` over them (what ``forge config check`` and the tests read)."""
    return apply_live(load_config(application.get("args") or {}), gateway_user_config(application))


def serve_config_forge(serve_config: Mapping[str, Any], app: str = "forge") -> ForgeConfig:
    """The whole of Forge that a Serve config file describes, as one configuration: the
    gateway application ``app`` as it serves (``application_config``), with each pool that runs
    in an application of its own inlined from there (its engine, routing and deployment; the
    gateway's entry keeps the rest). What the in-process runner and the tests build from, and
    the cross-application check: a pool's application exists, builds a pool, and serves the
    model the gateway lists under the same name, task, token default and timeouts (both sides
    read them: the configs write them once, an anchor the pool's application merges in)."""
    applications = {a.get("name"): a for a in serve_config.get("applications") or []}
    if app not in applications:
        raise ConfigError(f"no application named {app!r} in the Serve config")
    config = application_config(applications[app])
    problems, inlined = [], []
    for i, pool in enumerate(config.pools):
        if pool.app is None:
            inlined.append(pool)
            continue
        where = f"  pools.{i}.app: application {pool.app!r}"
        own = applications.get(pool.app)
        if own is None:
            problems.append(f"{where} is not in the Serve config")
            continue
        if not str(own.get("import_path", "")).endswith(":build_pool"):
            problems.append(f"{where} is not built by serve_app.app:build_pool")
            continue
        try:
            theirs = load_pool_app_config(own.get("args")).pool
        except ConfigError as err:
            problems.append(f"{where}: {err}")
            continue
        window, engine_len = pool.context_window, theirs.engine.max_model_len
        if window is not None and engine_len is not None and window > engine_len:
            problems.append(
                f"  pools.{i}.context_window: {window} is more than the engine.max_model_len "
                f"({engine_len}) of application {pool.app!r}"
            )
        for field in POOL_SHARED_FIELDS:
            if getattr(theirs, field) != getattr(pool, field):
                problems.append(
                    f"{where} has {field} {getattr(theirs, field)!r}, the gateway lists "
                    f"{getattr(pool, field)!r}"
                )
        update = {field: getattr(theirs, field) for field in POOL_APP_FIELDS}
        inlined.append(pool.model_copy(update={**update, "app": None}))
    problems += _control_app_problems(config, applications)
    if problems:
        raise ConfigError("invalid Serve config:\n" + "\n".join(problems))
    return config.model_copy(update={"pools": inlined, "control_app": None})


def _control_app_problems(config: ForgeConfig, applications: Mapping[str, Any]) -> list[str]:
    """The control application exists, builds the control, and holds a scheduler for every
    pool the gateway admits (a missing one would leave that pool admitted without slots; a
    spare one is idle, so that dropping a pool's admission need not change these args)."""
    if config.control_app is None:
        return []
    where = f"  control_app: application {config.control_app!r}"
    own = applications.get(config.control_app)
    if own is None:
        return [f"{where} is not in the Serve config"]
    if not str(own.get("import_path", "")).endswith(":build_control"):
        return [f"{where} is not built by serve_app.app:build_control"]
    try:
        listed = set(load_control_app_config(own.get("args")).schedulers)
    except ConfigError as err:
        return [f"{where}: {err}"]
    missing = sorted({p.name for p in config.pools if p.admission is not None} - listed)
    return [f"{where} has no scheduler for pools {missing}"] if missing else []
