"""Forge's configuration: the ``args`` of a Ray Serve config file, validated at start-up.

Config is data. A mistake stops the application before it serves, with a message that names
the field (``pools.0.engine.max_num_seqs: Input should be greater than 0``). Only secrets and
endpoints come from the environment, and only by the variable names written here.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
    model_validator,
)

from serve_app.config.base import NAME, EnvName, Strict
from serve_app.config.traffic import FALLBACK, ModelPolicy
from serve_app.kvcache.curve import curve_available
from serve_app.kvcache.events import DEFAULT_MAX_MESSAGE_BYTES
from serve_app.routing.registry import KV_EVENT_POLICIES, POLICY_NAMES, build_policy

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def is_key_hash(value: object) -> bool:
    """A lowercase SHA-256 hex digest, the only form an API key is ever stored in."""
    return isinstance(value, str) and _SHA256.match(value) is not None


def _key_hashes(hashes: list[str]) -> list[str]:
    if not all(is_key_hash(h) for h in hashes):
        raise ValueError(
            "each key hash must be a lowercase SHA-256 hex digest (64 chars); "
            "run `forge keys new --tenant NAME` to make one"
        )
    return hashes


# API keys as stored: SHA-256 digests only (tenants' and operators').
KeyHashes = Annotated[list[str], AfterValidator(_key_hashes)]

_NAME = NAME
_Strict = Strict


class TenantLimits(_Strict):
    """A tenant's budgets. Unset means unlimited; bursts default to one minute's worth."""

    rpm: Annotated[int, Field(gt=0)] | None = None
    tpm: Annotated[int, Field(gt=0)] | None = None
    burst_requests: Annotated[int, Field(gt=0)] | None = None
    burst_tokens: Annotated[int, Field(gt=0)] | None = None
    # Requests in flight at once (streaming or not): each holds a lease until it ends.
    max_concurrent_streams: Annotated[int, Field(gt=0)] | None = None


class TenantConfig(_Strict):
    name: Annotated[str, Field(pattern=_NAME)]
    # Fair admission: share of contended slots, queue length, priority tier.
    tier: Literal["interactive", "batch"] = "interactive"
    # Whether requests may pick their tier with ``x-forge-priority: interactive|batch``.
    allow_priority_header: bool = False
    queue_cap: Annotated[int, Field(ge=0)] | None = None
    # SHA-256 hex digests of the tenant's API keys; two while a key is rotated. May be empty
    # when the tenant's hashes come from the mounted ``key_hashes_file``.
    key_hashes: KeyHashes = Field(default_factory=list)
    weight: Annotated[float, Field(gt=0)] = 1.0
    limits: TenantLimits = TenantLimits()
    # Whose cached answers this tenant may be served: its own only ("tenant"), or those of every
    # tenant that also chose "shared" (same prompts, same model, one answer: cheaper). A hit on
    # another tenant's entry is told as a miss, at the miss's pace (``stages/cache.py``): it
    # saves GPU work, not latency, and does not say what another asked.
    cache_scope: Literal["tenant", "shared"] = "tenant"
    # While the shared store (Redis) is unreachable: "local" holds the tenant to each gateway
    # replica's share of its limits (1 / the gateway replicas), in that replica's memory;
    # "open" serves it unmetered; "closed" refuses its requests (503) until the store is back.
    on_store_failure: Literal["local", "open", "closed"] = "local"
    # The models this tenant may call (pools' models and ``models:`` entries); any other is a
    # 404 to it, as if it did not exist, and /v1/models lists only these. None: every one.
    models: list[Annotated[str, Field(min_length=1)]] | None = None
    # LoRA adapters this tenant is bound to, by base model: its requests for that model (by
    # its name or an alias of its pool) are served by the adapter (``serve_app/adapters.py``).
    adapters: dict[Annotated[str, Field(min_length=1)], Annotated[str, Field(pattern=_NAME)]] = (
        Field(default_factory=dict)
    )


class AdapterConfig(_Strict):
    """A LoRA adapter the pool's replicas load on demand, called as ``<model>:<name>``
    (``docs/adapters.md``). In PEFT's format: a directory with ``adapter_config.json`` and
    ``adapter_model.safetensors``."""

    name: Annotated[str, Field(pattern=_NAME)]
    # Where the replicas read it: a local directory (the simulator only names it); on the
    # cluster, a directory of the weights bucket as the replica's node mounts it.
    path: Annotated[str, Field(min_length=1)]
    # The tenants who may call it by name (``<model>:<name>`` or a models: entry), besides
    # those bound to it; None: every tenant that may call the pool's model.
    tenants: list[Annotated[str, Field(pattern=_NAME)]] | None = None


class SimulatedEngineConfig(_Strict):
    """The simulated vLLM's shape and timing (see ``engines/simulated_llm.py``)."""

    kind: Literal["simulated"] = "simulated"
    max_num_seqs: Annotated[int, Field(gt=0)] = 8
    block_size: Annotated[int, Field(gt=0)] = 16
    num_kv_blocks: Annotated[int, Field(gt=0)] = 4096
    max_model_len: Annotated[int, Field(gt=0)] = 8192
    prefill_base_s: Annotated[float, Field(ge=0)] = 0.0
    prefill_per_token_s: Annotated[float, Field(ge=0)] = 0.0
    decode_base_s: Annotated[float, Field(ge=0)] = 0.0
    decode_per_seq_s: Annotated[float, Field(ge=0)] = 0.0
    output_tokens_min: Annotated[int, Field(ge=1)] = 16
    output_tokens_max: Annotated[int, Field(ge=1)] = 64
    # Chunked prefill's budget: tokens computed per step, decodes one each (vLLM's default).
    max_num_batched_tokens: Annotated[int, Field(gt=0)] = 2048
    # Length of the vectors a ``task: embed`` pool returns (``engines/embeddings.py``).
    embedding_dim: Annotated[int, Field(gt=0)] = 384
    # Benchmarks only (``loadtest/concurrency.py``): each stream generates on a timer of its own
    # at this rate, outside the batched steps, and each token's text is the engine's clock when
    # it sent it, so a client can subtract the engine's own schedule (``engines/paced.py``).
    paced_tokens_per_s: Annotated[float, Field(gt=0)] | None = None
    # LoRA adapters resident at once (vLLM's max_loras): a batch holds requests of at most
    # this many adapters; another waits for a slot, and loading one costs adapter_load_s.
    max_loras: Annotated[int, Field(gt=0)] = 4
    adapter_load_s: Annotated[float, Field(ge=0)] = 0.0
    # A reasoning model served with vLLM's reasoning parser: a chat answer's first this many
    # tokens are its reasoning (``reasoning``, and ``completion_tokens_details``), unless the
    # request turns thinking off as Qwen3's template reads it (``chat_template_kwargs``'
    # ``enable_thinking: false``). 0: a model that does not reason, served without a parser.
    reasoning_tokens: Annotated[int, Field(ge=0)] = 0

    @model_validator(mode="after")
    def _ranges(self) -> SimulatedEngineConfig:
        if self.output_tokens_max < self.output_tokens_min:
            raise ValueError("output_tokens_max must be >= output_tokens_min")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (as in vLLM)")
        return self


class VLLMEngineConfig(_Strict):
    """The real vLLM, in the replica's process (see ``engines/vllm_engine.py``).

    The served model name is the pool's ``model``. The fields here are the vLLM engine arguments
    Forge itself depends on; anything else goes in ``engine_args`` under vLLM's own (Python)
    argument names, e.g. ``{kv_cache_memory_bytes: 268435456, quantization: awq}``.
    """

    kind: Literal["vllm"]
    # A local directory or a Hugging Face id (the image or a volume must already hold it).
    model: Annotated[str, Field(min_length=1)]
    # Sent to vLLM explicitly (never its default), because Forge uses both: the replica's
    # Serve queue is sized from max_num_seqs, and the routers hash prompts in block_size blocks.
    max_num_seqs: Annotated[int, Field(gt=0)] = 16
    block_size: Annotated[int, Field(gt=0)] = 16
    max_model_len: Annotated[int, Field(gt=0)] | None = None  # None: the model's own
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    enforce_eager: bool = False
    # Prefix-affinity and KV-aware routing only pay off with vLLM's prefix cache on.
    enable_prefix_caching: bool = True
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    # vLLM's own vllm:* metrics go to Ray's metrics agent (and so to the cluster's Prometheus),
    # as Ray Serve LLM does; off, they stay in the replica process's Prometheus registry.
    export_metrics_to_ray: bool = True
    # LoRA (only with the pool's ``adapters``): adapters in one batch, and the largest rank
    # any of them has (vLLM sizes its LoRA buffers by it; one of vLLM's choices).
    max_loras: Annotated[int, Field(gt=0)] = 4
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] = 16
    engine_args: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _no_shadowed_args(self) -> VLLMEngineConfig:
        shadowed = sorted(set(self.engine_args) & (set(type(self).model_fields) | {"model"}))
        if shadowed:
            raise ValueError(f"engine_args {shadowed} have their own fields; set them there")
        return self


_ENGINE_CONFIGS: dict[str, type[_Strict]] = {
    "simulated": SimulatedEngineConfig,
    "vllm": VLLMEngineConfig,
}


def _engine_config(value: Any) -> SimulatedEngineConfig | VLLMEngineConfig:
    """Pick the engine's config class by ``kind`` (absent: simulated).

    A discriminated union by hand: pydantic's own puts the tag in every error's location
    (``pools.0.engine.simulated.max_num_seqs``); this keeps ``pools.0.engine.max_num_seqs``.
    """
    if isinstance(value, SimulatedEngineConfig | VLLMEngineConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError("engine must be a mapping with a kind: simulated or vllm")
    kind = value.get("kind", "simulated")
    config_class = _ENGINE_CONFIGS.get(kind) if isinstance(kind, str) else None
    if config_class is None:
        raise ValueError(f"engine.kind must be one of {sorted(_ENGINE_CONFIGS)}, not {kind!r}")
    return config_class.model_validate(value)


EngineConfig = Annotated[SimulatedEngineConfig | VLLMEngineConfig, BeforeValidator(_engine_config)]


class AdmissionConfig(_Strict):
    """Fair admission in front of a pool: its slot budget and how requests wait for it."""

    max_inflight: Annotated[int, Field(gt=0)]
    queue_cap: Annotated[int, Field(ge=0)] = 8  # per tenant, unless the tenant sets its own
    deadline_s: Annotated[float, Field(gt=0)] = 10.0  # longest wait in a queue before a 429
    lease_ttl_s: Annotated[float, Field(gt=0)] = 30.0  # a dead gateway's slots come back after
    max_queued_total: Annotated[int, Field(gt=0)] | None = None
    batch_every: Annotated[int, Field(ge=2)] = 5  # while both tiers wait, 1 grant in N is batch
    # Most of the slots one tenant may hold: the rest is headroom for others to start at once.
    max_tenant_share: Annotated[float, Field(gt=0, le=1)] = 1.0
    # How long a gateway replica keeps a finished request's slot for its next request while
    # nobody is queued (admission without a scheduler call; admission/warm_slots.py). 0: never.
    keep_warm_s: Annotated[float, Field(ge=0)] = 10.0

    @model_validator(mode="after")
    def _parked_slots_outlive_no_lease(self) -> AdmissionConfig:
        if self.keep_warm_s > self.lease_ttl_s / 2:
            raise ValueError(
                f"keep_warm_s ({self.keep_warm_s}) must be at most half of lease_ttl_s "
                f"({self.lease_ttl_s}): a parked slot is not renewed"
            )
        return self


class KvEventsConfig(_Strict):
    """A kv_aware pool's KV-event sockets (``serve_app/kvcache/events.py``, docs/security.md):
    the replicas serve them, the routers of every gateway replica subscribe."""

    # curve: encrypted, and only holders of the cluster's key get in (kvcache/curve.py);
    # none: plaintext, which a replica refuses on any address beyond loopback.
    auth: Literal["curve", "none"] = "curve"
    # The secret key (Z85) of the cluster's one keypair, from this variable (a Kubernetes
    # secret); unset in the process: a keypair made for the Ray cluster, kept in its GCS.
    curve_secret_env: EnvName = "FORGE_KV_CURVE_SECRET"
    # The largest message a router takes: a snapshot, ~9 bytes a block (16 MiB: 1.8M blocks).
    max_message_bytes: Annotated[int, Field(ge=64 * 1024)] = DEFAULT_MAX_MESSAGE_BYTES
    # Snapshot requests a replica answers per peer address: a burst, then so many a second.
    snapshot_burst: Annotated[int, Field(ge=1)] = 8
    snapshot_rate_per_s: Annotated[float, Field(gt=0)] = 2.0


class RoutingConfig(_Strict):
    """How a pool's replica is chosen for each request (see ``serve_app/routing/``)."""

    # The registry's names (``routing.registry.POLICY_NAMES``): one list, not two to keep in step.
    policy: Literal[POLICY_NAMES] = "power_of_two"  # Serve's own, run by Forge's router
    options: dict[str, Any] = Field(default_factory=dict)  # the policy's constructor arguments
    # How often replicas report their load and cache state to the routers.
    stats_period_s: Annotated[float, Field(gt=0)] = 1.0
    kv_events: KvEventsConfig = KvEventsConfig()
    # A request for a LoRA adapter goes first to replicas that have it loaded, while their
    # load stays under adapter_load_factor x the mean + 1 (``routing/adapters.py``); off, the
    # policy alone decides (adapters load wherever it sends them).
    adapter_affinity: bool = True
    adapter_load_factor: Annotated[float, Field(ge=1)] = 1.25

    @model_validator(mode="after")
    def _policy_builds(self) -> RoutingConfig:
        """The policy is built here as the routers will build it: a bad option fails the config
        with its name, not a router in every gateway (a pool that never becomes routable)."""
        options = dict(self.options)
        route_blocks = options.pop("route_blocks", 128)  # the router's own, not the policy's
        if not isinstance(route_blocks, int) or isinstance(route_blocks, bool) or route_blocks < 1:
            raise ValueError(f"options.route_blocks must be an integer >= 1, got {route_blocks!r}")
        try:
            build_policy(self.policy, **options)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"options: {exc}") from None
        if self.policy in KV_EVENT_POLICIES and self.kv_events.auth == "curve":
            if not curve_available():  # refused here, never a silent fall back to plaintext
                raise ValueError(
                    "kv_events.auth: curve needs a libzmq built with CURVE, which this pyzmq's "
                    "is not (zmq.has('curve') is False); install pyzmq's wheel, or on a "
                    "loopback-only laptop set kv_events.auth: none"
                )
        return self


class BreakerConfig(_Strict):
    """Circuit breakers (per replica, per pool, for the fallback): when a backend is known dead."""

    failure_threshold: Annotated[int, Field(gt=0)] = 5  # consecutive failures open it
    failure_ratio: Annotated[float, Field(gt=0, le=1)] = 0.5  # ... or this share over the window
    window_s: Annotated[float, Field(gt=0)] = 10.0
    min_requests: Annotated[int, Field(gt=0)] = 20  # outcomes needed before the ratio counts
    cooldown_s: Annotated[float, Field(gt=0)] = 5.0  # open → half-open (one probe)
    probe_timeout_s: Annotated[float, Field(gt=0)] = 30.0  # an unanswered probe is released


class RetryBudgetConfig(_Strict):
    """Retries (another replica or the fallback, before byte one) stay under this share."""

    ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    window_s: Annotated[float, Field(gt=0)] = 10.0
    # Per window and gateway replica, for quiet times: at least the failures that open a breaker
    # (ResilienceConfig checks), or a quiet pool's outage reaches clients before its breaker opens.
    min_retries: Annotated[int, Field(ge=0)] = 5


class ResilienceConfig(_Strict):
    breaker: BreakerConfig = BreakerConfig()
    retry_budget: RetryBudgetConfig = RetryBudgetConfig()
    # How stale a gateway replica's copy of the shared breaker states may get (failures and
    # probe results are pushed at once; this bounds how late *other* replicas hear of them).
    sync_interval_s: Annotated[float, Field(gt=0)] = 0.5
    # How often the fallback's health endpoint is probed while no traffic tells us.
    fallback_probe_interval_s: Annotated[float, Field(gt=0)] = 10.0

    @model_validator(mode="after")
    def _budget_covers_a_trip(self) -> ResilienceConfig:
        """Each failure before a breaker opens is a retry or a client's error: a floor below the
        threshold makes every outage at low traffic visible to clients."""
        need = self.breaker.failure_threshold
        if self.retry_budget.min_retries < need:
            raise ValueError(
                f"retry_budget.min_retries ({self.retry_budget.min_retries}) must be at least "
                f"breaker.failure_threshold ({need}): the failures that open a breaker are "
                "retried on the fallback, and at low traffic the floor is the whole budget"
            )
        return self


class PoolConfig(_Strict):
    """A primary pool: one replica deployment serving one model."""

    name: Annotated[str, Field(pattern=_NAME)] = "primary"
    model: Annotated[str, Field(min_length=1)]
    # What the model does: "generate" serves /v1/chat/completions and /v1/completions, "embed"
    # serves /v1/embeddings (vLLM's pooling runner; the simulator's deterministic vectors).
    task: Literal["generate", "embed"] = "generate"
    engine: EngineConfig = SimulatedEngineConfig()
    # Default for requests that omit max_tokens.
    default_max_tokens: Annotated[int, Field(gt=0)] = 256
    # A replica must take the request by then (assignment; a pool at capacity or being replaced).
    connect_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    # A replica that has not started answering by then is failed over (never a hang).
    first_token_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    # A stream that goes this long without a token has hung (a slow one has not).
    idle_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    # Total deadline of a request, streaming or not: long enough for the longest healthy answer.
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    # The longest prompt plus completion the pool's engine takes (its max_model_len), in
    # tokens: a longer request is routed down a model's chain to a pool that takes it
    # (``context_length``), or refused with a 400 when none is left. None: not checked here.
    context_window: Annotated[int, Field(gt=0)] | None = None
    # Whether requests for this pool's model may be served by the fallback backend. Never for
    # an embedding pool: another model's vectors live in another space, so an index built from
    # this pool's would silently stop matching.
    fallback: bool = True
    admission: AdmissionConfig | None = None
    routing: RoutingConfig = RoutingConfig()
    # LoRA adapters over the pool's model, each called as ``<model>:<name>``.
    adapters: list[AdapterConfig] = Field(default_factory=list)
    # Ray Serve deployment options, passed through (num_replicas, autoscaling_config,
    # ray_actor_options, max_ongoing_requests, graceful_shutdown_timeout_s, ...).
    deployment: dict[str, Any] = Field(default_factory=dict)
    # The Serve application the pool runs in, when not the gateway's own (``serve_app.app:
    # build_pool``, its args ``{pool: {...}}``). Serve versions an application's deployments by
    # its whole args, so a pool in the gateway's application is replaced by any change there,
    # and replaces the gateway when it changes; in its own application, a change to its engine
    # or deployment rolls that pool alone. The gateway finds ``pool-<name>`` there by name.
    app: Annotated[str, Field(pattern=_NAME)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _runs_elsewhere(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("app") is not None:
            theirs = sorted(POOL_APP_FIELDS & set(data))
            if theirs:
                raise ValueError(
                    f"pool {data.get('name', 'primary')}: {', '.join(theirs)}: set in the "
                    f"args of application {data['app']!r} (the pool runs there), not in the "
                    "gateway's (in the pool's own application, a pool names no app: take "
                    "app out of an anchor both share)"
                )
        return data

    @model_validator(mode="before")
    @classmethod
    def _embeddings_never_fail_over(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("task") == "embed":
            if data.get("fallback") is True:
                raise ValueError(
                    f"pool {data.get('name', 'primary')}: an embedding pool cannot fail over "
                    "(the fallback's vectors are not comparable with this model's); drop "
                    "'fallback: true'"
                )
            data = {**data, "fallback": False}
        return data

    @model_validator(mode="after")
    def _default_max_tokens_fits(self) -> PoolConfig:
        window = self.context_limit()
        if window is not None and self.task == "generate" and self.default_max_tokens > window:
            raise ValueError(
                f"pool {self.name}: default_max_tokens ({self.default_max_tokens}) is more than "
                f"its context window ({window}): every request without max_tokens would be "
                "refused (vLLM's 400 for a max_tokens past max_model_len)"
            )
        return self

    @model_validator(mode="after")
    def _adapters(self) -> PoolConfig:
        if not self.adapters:
            return self
        where = f"pool {self.name}: adapters"
        if self.task != "generate":
            raise ValueError(f"{where}: LoRA adapters serve generation pools only (task: generate)")
        names = [a.name for a in self.adapters]
        dupes = sorted(n for n, count in Counter(names).items() if count > 1)
        if dupes:
            raise ValueError(f"{where}: duplicate names {dupes}")
        return self

    def adapter(self, name: str) -> AdapterConfig | None:
        return next((a for a in self.adapters if a.name == name), None)

    def context_limit(self) -> int | None:
        """The context window the gateway routes by: the one written here, else (a pool in the
        gateway's own application) its engine's max_model_len."""
        if self.context_window is not None or self.app is not None:
            return self.context_window
        return self.engine.max_model_len

    def engine_identity(self) -> str:
        """What the pool's answers depend on besides the request: the weights and their
        revision for vLLM, the whole engine config for the simulator. Part of every cache key,
        so a new model or revision never replays the old one's answers."""
        engine = self.engine
        if isinstance(engine, VLLMEngineConfig):
            revision = engine.engine_args.get("revision") or ""
            return f"vllm:{engine.model}@{revision}:{engine.engine_args.get('quantization') or ''}"
        return "simulated:" + engine.model_dump_json()


# What a pool in its own application sets there (``PoolConfig.app``); the gateway's entry keeps
# what the gateway uses: model, task, timeouts, fallback, admission.
POOL_APP_FIELDS = frozenset({"engine", "routing", "deployment"})
# What both the gateway's entry for a pool and the pool's own application read: one value,
# held equal across the two by ``serve_config_forge`` (``forge config check``).
POOL_SHARED_FIELDS = (
    "adapters",
    "name",
    "model",
    "task",
    "default_max_tokens",
    "connect_timeout_s",
    "first_token_timeout_s",
    "idle_timeout_s",
    "request_timeout_s",
)


# The chat parameters Gemini's OpenAI-compatible endpoint documents (Vertex AI, "Using OpenAI
# libraries": supported parameters); it refuses any other top-level field with a 400 ("Unknown
# name ... Cannot find field"). `extra_body` is how Gemini-specific options travel.
GEMINI_PARAMS: tuple[str, ...] = (
    "model",
    "messages",
    "prompt",  # /v1/completions bodies, for upstreams that serve it
    "max_tokens",
    "max_completion_tokens",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "reasoning_effort",
    "response_format",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "web_search_options",
    "modalities",
    "audio",
    "extra_body",
)


class FallbackConfig(_Strict):
    """An external OpenAI-compatible backend (Gemini in production, the mock on a laptop)."""

    base_url: Annotated[str, Field(pattern=r"^https?://")]
    # The upstream's model name; requests for a pool's model are rewritten to it on failover.
    model: Annotated[str, Field(min_length=1)]
    # Name of the environment variable holding the API key (a secret: never in config).
    api_key_env: EnvName | None = None
    # How Forge authenticates upstream: "api_key" (a bearer key from ``api_key_env``),
    # "gcp_metadata" (a short-lived token from the GCE/GKE metadata server: workload identity,
    # no secret to rotate) or "none". Unset: "api_key" when ``api_key_env`` is set, else "none".
    auth: Literal["none", "api_key", "gcp_metadata"] = "none"
    # Where "gcp_metadata" fetches its token; overridable so tests can run a fake server.
    metadata_url: Annotated[str, Field(pattern=r"^https?://")] = (
        "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token"
    )
    # What the readiness probe GETs, relative to ``base_url``. None for an upstream with nothing
    # to GET (Vertex AI's OpenAI endpoint): the probe then checks only the credentials.
    health_path: str | None = "models"
    # The four timeouts: connect, first token, idle between tokens (a read), total deadline.
    connect_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    first_token_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    read_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 600.0
    max_connections: Annotated[int, Field(gt=0)] = 256
    # The top-level request fields the upstream takes; others (vLLM's sampling extensions such as
    # top_k or ignore_eos, `user`, `logit_bias`, `parallel_tool_calls`, ...) are dropped on the
    # way out, so a failover never turns into a client's 400 over a field. None: forward all.
    accepted_params: tuple[str, ...] | None = GEMINI_PARAMS
    # Gemini 3 refuses a current turn's function call without its thought signature, as a call
    # the primary made has none: such a call gets Google's placeholder on the way out
    # (``serve_app/backends/gemini_compat.py``). Off for an upstream that is not Gemini: another
    # API may refuse the field.
    fill_thought_signatures: bool = True
    # The OpenAI routes the upstream serves; a pool's request on another route is not failed
    # over (its own error stands, not the upstream's 404). Gemini serves chat only.
    kinds: tuple[Literal["chat", "completion"], ...] = ("chat",)

    @model_validator(mode="before")
    @classmethod
    def _default_auth(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("auth") is None:
            return {**data, "auth": "api_key" if data.get("api_key_env") else "none"}
        return data

    @model_validator(mode="after")
    def _auth_mode(self) -> FallbackConfig:
        if self.auth == "api_key" and not self.api_key_env:
            raise ValueError("auth 'api_key' needs api_key_env (the variable holding the key)")
        if self.auth != "api_key" and self.api_key_env:
            raise ValueError(f"api_key_env is only used with auth 'api_key', not {self.auth!r}")
        return self


class _StoreEndpoint(_Strict):
    """A Redis the gateway reaches for shared state, or none (the embedded store). ``store`` and
    ``cache.store`` are each one of these."""

    # Where this sits in the config, and the way back to no Redis: for the start-up error.
    config_path: ClassVar[str] = "store"
    without_it: ClassVar[str] = (
        "remove store.redis_url_env to use the embedded store (one gateway replica only)"
    )

    # The Redis endpoint, directly or (preferred, it may hold a password) by env variable name.
    # Naming a variable is configuring Redis: if it is unset at start-up, start-up fails; the
    # embedded store is never a silent substitute (it would give each gateway its own budget).
    redis_url: str | None = None
    redis_url_env: EnvName | None = None
    key_prefix: str = "forge:"
    # Per call: the store is on the request path and fails open, so slow means gone.
    timeout_s: Annotated[float, Field(gt=0)] = 0.05
    # When a store that stops answering is skipped (each call failing at once, served
    # unmetered or uncached) and how soon one call probes it again (``store/guarded.py``).
    breaker: BreakerConfig = BreakerConfig(failure_threshold=3, cooldown_s=1.0, probe_timeout_s=5.0)

    @property
    def shared(self) -> bool:
        """Whether a shared store (Redis) is configured, resolvable or not."""
        return bool(self.redis_url or self.redis_url_env)

    def resolved_url(self) -> str | None:
        """The Redis URL, or None for the embedded store; ``ConfigError`` when Redis is
        configured by a variable that is not set (and no ``redis_url`` stands in for it)."""
        import os

        if self.redis_url_env and os.environ.get(self.redis_url_env):
            url = os.environ[self.redis_url_env]
            if url.split("://", 1)[0] not in ("redis", "rediss", "unix") or "://" not in url:
                # Said without the value: a URL may hold a password.
                raise ConfigError(
                    f"{self.config_path}.redis_url_env names {self.redis_url_env}, which does "
                    "not hold a Redis URL (redis://, rediss:// or unix://host:port/db)"
                )
            return url
        if self.redis_url_env and not self.redis_url:
            raise ConfigError(
                f"{self.config_path}.redis_url_env names {self.redis_url_env}, which is not set "
                "in the gateway's environment: set it to the Redis URL (redis://host:6379/0), or "
                + self.without_it
            )
        return self.redis_url


class StoreConfig(_StoreEndpoint):
    """Where budgets live (token buckets, stream leases, settles' idempotency ids): Redis when
    configured, else the embedded (one-process) store. Also the response cache's, unless
    ``cache.store`` gives the cache a Redis of its own. A Redis that holds budgets must never
    evict (``maxmemory-policy noeviction``): an evicted bucket is a refilled budget, an evicted
    idempotency id a refund applied twice."""

    # Off the request path (usage writes, usage reports), a slow reply is worth waiting for.
    background_timeout_s: Annotated[float, Field(gt=0)] = 1.0


class CacheStoreConfig(_StoreEndpoint):
    """The response cache's own Redis, apart from the budgets' (``store``). Cached answers are
    the one thing the store holds that may be evicted or lost: on their own instance they can
    fill it (``allkeys-lru``) without pushing a budget out, and a cheaper tier that loses them
    in a restart costs a cold cache, nothing more."""

    config_path: ClassVar[str] = "cache.store"
    without_it: ClassVar[str] = "remove cache.store for the cache to share store"

    @model_validator(mode="after")
    def _names_a_redis(self) -> CacheStoreConfig:
        if not self.shared:
            raise ValueError(
                "cache.store needs redis_url or redis_url_env (the cache's own Redis); without "
                "one, leave cache.store out and the cache shares store"
            )
        return self


class CacheConfig(_Strict):
    """The response cache (``stages/cache_rules.py``): deterministic answers, kept per tenant."""

    enabled: bool = True
    ttl_s: Annotated[float, Field(gt=0)] = 3600.0
    # An answer larger than this is served but not kept.
    max_entry_bytes: Annotated[int, Field(gt=0)] = 256 * 1024
    # The embedded store's total for cached answers (least recently used go first); Redis is
    # bounded by its own maxmemory policy.
    max_memory_bytes: Annotated[int, Field(gt=0)] = 64 * 1024 * 1024
    # The cache's own Redis (``CacheStoreConfig``); None: the cache shares ``store``.
    store: CacheStoreConfig | None = None


class ResponsesConfig(_Strict):
    """Stored responses (``POST /v1/responses`` with ``store``, continued by
    ``previous_response_id``): kept in the cache's store, per tenant (``dialects/stored.py``)."""

    # OpenAI keeps stored responses 30 days.
    stored_ttl_s: Annotated[float, Field(gt=0)] = 30 * 86_400.0
    # A conversation larger than this (the whole history a follow-up continues) is served but
    # not stored (logged): a follow-up to it is a 404.
    max_stored_bytes: Annotated[int, Field(gt=0)] = 1024 * 1024


class ModelPrice(_Strict):
    """What a model's tokens cost, per million: what ``forge usage`` multiplies by."""

    prompt_per_million: Annotated[float, Field(ge=0)] = 0.0
    completion_per_million: Annotated[float, Field(ge=0)] = 0.0
    # Tokens answered from the cache; by default free (nothing was generated).
    cached_per_million: Annotated[float, Field(ge=0)] = 0.0


class MeteringConfig(_Strict):
    """Usage per tenant, model and day, kept in a durable ledger (``metering/ledger.py``)."""

    enabled: bool = True
    # The ledger: PostgreSQL at the URL in this variable (a secret: it may hold a password);
    # naming it is configuring it, so an unset variable stops start-up. Without it, SQLite in
    # the file at sqlite_path (a laptop's; every gateway replica of the machine shares it;
    # None: ~/.local/share/forge/usage.sqlite3, ``metering.ledger.DEFAULT_SQLITE_PATH``).
    database_url_env: EnvName | None = None
    sqlite_path: str | None = None
    # How long a day's counts are kept: long enough for a year's invoices and their disputes.
    retention_days: Annotated[int, Field(gt=0, le=3660)] = 400
    # How often a gateway replica writes its queued usage (one transaction for all of it): a
    # report lags by about this much (and, without the journal, a replica that dies loses it).
    flush_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    # Each replica's queued usage also in a file (``metering/journal.py``), so a replica that
    # is killed loses none of it: another one sharing the directory writes it. The directory
    # (None: beside the SQLite file, or ~/.local/share/forge/journal-<database> for
    # PostgreSQL) must be shared by the replicas of one machine, and is the ledger's alone.
    journal: bool = True
    journal_dir: str | None = None
    currency: str = "USD"
    prices: dict[str, ModelPrice] = Field(default_factory=dict)  # served model name → price

    @model_validator(mode="after")
    def _one_ledger(self) -> MeteringConfig:
        if self.database_url_env and self.sqlite_path:
            raise ValueError(
                "metering: database_url_env and sqlite_path name two ledgers; the PostgreSQL "
                "one is used, so drop sqlite_path (or database_url_env, for the file)"
            )
        return self


class AdminConfig(_Strict):
    """Operators' keys for ``/admin/*`` (kept as SHA-256 digests, like tenants' keys)."""

    key_hashes: KeyHashes = Field(default_factory=list)
    # A mounted secret with more: YAML or JSON ``[sha256, ...]``.
    key_hashes_file: str | None = None


class TracingConfig(_Strict):
    """OpenTelemetry traces. Exported (OTLP over HTTP) only where OTEL_EXPORTER_OTLP_ENDPOINT is
    set; without it nothing is traced and the request path pays nothing."""

    # Head sampling of new traces; a client's own traceparent decides for its requests.
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1


class AuthThrottleConfig(_Strict):
    """Wrong keys (``serve_app/auth/throttle.py``): past these many in ``window_s`` from one
    client address or under one key prefix, the answer is 429 + Retry-After instead of 401.
    Behind a proxy that adds no X-Forwarded-For every client shares an address: keep that limit
    well above any honest client's mistakes. A valid key is never throttled."""

    max_failures_per_address: Annotated[int, Field(gt=0)] = 200
    max_failures_per_prefix: Annotated[int, Field(gt=0)] = 50
    window_s: Annotated[float, Field(gt=0)] = 60.0
    max_tracked: Annotated[int, Field(gt=0)] = 10_000  # addresses and prefixes remembered


class GatewayConfig(_Strict):
    """Limits on what one request may bring, with safe defaults; each breach is an
    OpenAI-shaped 4xx before anything is spent on the request."""

    max_body_bytes: Annotated[int, Field(gt=0)] = 1 << 20
    # Messages in one chat request (a long agent transcript is hundreds).
    max_messages: Annotated[int, Field(gt=0)] = 2048
    # Request headers, names and values summed (431 above it).
    max_header_bytes: Annotated[int, Field(gt=0)] = 32 << 10
    # The whole body must arrive within this (a body sent a byte at a time is a 408).
    body_timeout_s: Annotated[float, Field(gt=0)] = 30.0
    # None: no throttle (every wrong key is a 401).
    auth_throttle: AuthThrottleConfig | None = AuthThrottleConfig()
    # Gateway replica deployment options (num_replicas, ray_actor_options, ...).
    deployment: dict[str, Any] = Field(default_factory=dict)


class FaultsConfig(_Strict):
    """Fault injection through ``POST /admin/faults`` (crash, errors, hangs on every replica of
    a pool): for drills and the deploy gate on a laptop or a staging graph, never production.
    Off unless a config turns it on; off, the route answers 403."""

    enabled: bool = False


class ForgeConfig(_Strict):
    gateway: GatewayConfig = GatewayConfig()
    store: StoreConfig = StoreConfig()
    # Empty here when the gateway deployment's user_config lists them, as it should to change
    # them live (serve_app/config/live.py); a gateway with no tenant at all will not start.
    tenants: list[TenantConfig] = Field(default_factory=list)
    # A mounted secret with more key hashes: YAML or JSON ``{tenant: [sha256, ...]}``.
    key_hashes_file: str | None = None
    pools: Annotated[list[PoolConfig], Field(min_length=1)]
    fallback: FallbackConfig | None = None
    resilience: ResilienceConfig = ResilienceConfig()
    tracing: TracingConfig = TracingConfig()
    cache: CacheConfig = CacheConfig()
    responses: ResponsesConfig = ResponsesConfig()
    metering: MeteringConfig = MeteringConfig()
    admin: AdminConfig = AdminConfig()
    faults: FaultsConfig = FaultsConfig()
    # The Serve application that holds the pools' schedulers and the breaker board
    # (``serve_app.app:build_control``, its args ``{schedulers: [pool, ...]}``), when not this
    # one: a change to this application's args then replaces the gateways alone, and the slot
    # budgets, queues and open breakers outlive it. The gateways send it their settings.
    control_app: Annotated[str, Field(pattern=_NAME)] | None = None
    # Public model names over the pools: aliases, weighted canaries, fallback chains, shadow
    # traffic (``config/traffic.py``). Live: ``user_config.models`` replaces the list.
    models: list[ModelPolicy] = Field(default_factory=list)

    @model_validator(mode="after")
    def _traffic(self) -> ForgeConfig:
        """Every name a model entry or a tenant's allow-list uses exists, chains do not come
        back on themselves; each problem with its field's path."""
        pools = {p.name: p.task for p in self.pools}
        public = {p.model for p in self.pools}
        if self.fallback is not None:
            public.add(self.fallback.model)
        problems = []
        for i, policy in enumerate(self.models):
            problems += policy.route_problems(
                f"models.{i}", pools, self.fallback is not None, public
            )
            public.add(policy.name)
        aliases = {policy.name for policy in self.models}
        for name in self.metering.prices:
            if name in aliases:
                # The ledger records the model that served a request, never the name asked.
                problems.append(
                    f"metering.prices.{name}: {name!r} is a models: entry; usage is recorded "
                    "under the served model's name (a pool's model, an adapter's "
                    "<model>:<adapter>, the fallback's): price those"
                )
        closed = {p.name for p in self.pools if not p.fallback}
        for i, policy in enumerate(self.models):
            kept = sorted({v.pool for v in policy.variants} & closed)
            for j, step in enumerate(policy.chain or []):
                if step.pool == FALLBACK and kept:
                    # The pool's word holds for every name that reaches it (an embedding
                    # pool's vectors, a tenant's data that must stay on the platform).
                    problems.append(
                        f"models.{i}.chain.{j}.pool: pool {kept[0]!r} has fallback: false, so "
                        "its requests never go to the fallback; drop this step (or allow the "
                        "fallback on the pool)"
                    )
        by_model = {p.model: p for p in self.pools}
        adapters = {f"{p.model}:{a.name}" for p in self.pools for a in p.adapters}
        tenants = {t.name for t in self.tenants}
        for i, policy in enumerate(self.models):
            for j, variant in enumerate(policy.variants):
                pool = next((p for p in self.pools if p.name == variant.pool), None)
                if variant.adapter is not None and pool is not None:
                    if pool.adapter(variant.adapter) is None:
                        problems.append(
                            f"models.{i}.variants.{j}.adapter: pool {pool.name!r} has no adapter "
                            f"named {variant.adapter!r}"
                        )
        for i, tenant in enumerate(self.tenants):
            unknown = sorted(set(tenant.models or ()) - public - adapters)
            if unknown:
                problems.append(f"tenants.{i}.models: no model is named {unknown}")
            for model, name in tenant.adapters.items():
                pool = by_model.get(model)
                if pool is None:
                    problems.append(f"tenants.{i}.adapters.{model}: no pool serves {model!r}")
                elif pool.adapter(name) is None:
                    problems.append(
                        f"tenants.{i}.adapters.{model}: pool {pool.name!r} has no adapter "
                        f"named {name!r}"
                    )
        for i, pool in enumerate(self.pools):
            for j, adapter in enumerate(pool.adapters):
                unknown = sorted(set(adapter.tenants or ()) - tenants)
                if unknown and self.tenants:  # tenants listed live (user_config) are not here
                    problems.append(f"pools.{i}.adapters.{j}.tenants: no tenant is named {unknown}")
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    @model_validator(mode="after")
    def _unique(self) -> ForgeConfig:
        for what, names in (
            ("tenants", [t.name for t in self.tenants]),
            ("pools", [p.name for p in self.pools]),
            ("pools.model", [p.model for p in self.pools]),
            ("pools.app", [p.app for p in self.pools if p.app is not None]),
        ):
            dupes = sorted(n for n, count in Counter(names).items() if count > 1)
            if dupes:
                raise ValueError(f"{what}: duplicate names {dupes}")
        if "fallback" in {p.name for p in self.pools}:
            raise ValueError("pools: 'fallback' is reserved for the fallback backend")
        deployment = self.gateway.deployment
        many_gateways = deployment.get("num_replicas", 1) not in (1, None) or bool(
            deployment.get("autoscaling_config")
        )
        if many_gateways and not self.store.shared:
            raise ValueError(
                "store: more than one gateway replica needs a shared store (store.redis_url or "
                "store.redis_url_env); the embedded store would give each replica its own budget"
            )
        if self.key_hashes_file is None and not all(t.key_hashes for t in self.tenants):
            missing = [t.name for t in self.tenants if not t.key_hashes]
            raise ValueError(f"tenants {missing} have no key_hashes and no key_hashes_file is set")
        hashes = [h for t in self.tenants for h in t.key_hashes]
        if len(hashes) != len(set(hashes)):
            raise ValueError("tenants: one key hash is listed for two tenants")
        if set(hashes) & set(self.admin.key_hashes):
            raise ValueError("admin.key_hashes: a tenant's key must not be an admin key too")
        return self


class PoolAppConfig(_Strict):
    """A pool's own application's args (``serve_app.app:build_pool``)."""

    pool: PoolConfig
    tracing: TracingConfig = TracingConfig()

    @model_validator(mode="after")
    def _here(self) -> PoolAppConfig:
        if self.pool.app is not None:
            raise ValueError("pool.app: this application is where the pool runs; drop it")
        return self


class ControlAppConfig(_Strict):
    """The control application's args (``serve_app.app:build_control``): which pools have a
    scheduler there. Names only: their settings come from the gateways, so that changing them
    never changes these args (which would replace every slot budget and breaker)."""

    schedulers: list[Annotated[str, Field(pattern=_NAME)]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> ControlAppConfig:
        dupes = sorted(n for n, count in Counter(self.schedulers).items() if count > 1)
        if dupes:
            raise ValueError(f"schedulers: duplicate names {dupes}")
        return self


class ConfigError(ValueError):
    """The config file is wrong; the message names every bad field."""


_Config = TypeVar("_Config", bound=BaseModel)


def load_config(args: dict[str, Any] | None) -> ForgeConfig:
    return _load(ForgeConfig, args, "invalid Forge config")


def load_pool_app_config(args: dict[str, Any] | None) -> PoolAppConfig:
    return _load(PoolAppConfig, args, "invalid Forge pool application config")


def load_control_app_config(args: dict[str, Any] | None) -> ControlAppConfig:
    return _load(ControlAppConfig, args, "invalid Forge control application config")


def _load(model: type[_Config], args: dict[str, Any] | None, title: str) -> _Config:
    try:
        return model.model_validate(args or {})
    except ValidationError as exc:
        raise ConfigError(f"{title}:\n" + _lines(exc)) from None


def _lines(exc: ValidationError) -> str:
    return "\n".join(
        f"  {'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
        for e in exc.errors(include_url=False)
    )
