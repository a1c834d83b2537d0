"""Config validation: the shipped config loads; every mistake names its field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from serve_app.auth.keys import KeyRing, hash_key
from serve_app.config.live import gateway_user_config, serve_config_forge
from serve_app.config.models import ConfigError, ForgeConfig, MeteringConfig, load_config
from serve_app.store import GuardedStore, MemoryStore, build_store, build_stores

LOCAL_YAML = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"
HASH_A = hash_key("key-a")
HASH_B = hash_key("key-b")


def minimal() -> dict:
    return {
        "tenants": [{"name": "alpha", "key_hashes": [HASH_A]}],
        "pools": [{"model": "m1"}],
    }


def local_args() -> dict:
    """configs/local.yaml's Forge config as one document: its args, its gateway's user_config
    over them (the tenants live there), its pools' own applications inlined."""
    with LOCAL_YAML.open() as f:
        return serve_config_forge(yaml.safe_load(f)).model_dump()


def config_error(args: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(args)
    return str(info.value)


def test_local_yaml_validates():
    config = load_config(local_args())
    assert isinstance(config, ForgeConfig)
    assert [t.name for t in config.tenants] == ["alpha", "beta"]
    assert config.pools[0].model == "forge-sim-1b"
    assert config.pools[0].engine.prefill_base_s == 0.02
    assert config.fallback is not None and config.fallback.api_key_env == "FORGE_FALLBACK_API_KEY"


def test_local_yaml_demo_keys_resolve_to_their_tenants():
    # The keys the config's comment documents must match the hashes it ships.
    ring = KeyRing(load_config(local_args()).tenants)
    assert ring.tenant_for("Bearer sk-demo-alpha-local-only").name == "alpha"
    assert ring.tenant_for("Bearer sk-demo-beta-local-only").name == "beta"


def test_minimal_config_gets_defaults():
    config = load_config(minimal())
    assert config.pools[0].name == "primary"
    assert config.pools[0].default_max_tokens == 256
    assert config.fallback is None


def test_missing_args_names_required_sections():
    message = config_error({})
    assert "pools: Field required" in message
    # Tenants may come from the gateway's user_config instead (tests/config/test_live.py).
    assert "tenants" not in message


def test_bad_field_message_names_its_path():
    args = minimal()
    args["pools"][0]["engine"] = {"max_num_seqs": 0}
    message = config_error(args)
    assert "pools.0.engine.max_num_seqs" in message
    assert "greater than 0" in message


def test_every_bad_field_is_named():
    args = minimal()
    args["pools"][0]["default_max_tokens"] = -1
    args["tenants"][0]["weight"] = 0
    message = config_error(args)
    assert "pools.0.default_max_tokens" in message
    assert "tenants.0.weight" in message


@pytest.mark.parametrize(
    ("where", "path"),
    [
        (lambda a: a.update(surprise=1), "surprise"),
        (lambda a: a["pools"][0].update(replicas=2), "pools.0.replicas"),
        (lambda a: a["pools"][0].update(engine={"max_seqs": 2}), "pools.0.engine.max_seqs"),
        (lambda a: a["tenants"][0].update(key="x"), "tenants.0.key"),
    ],
)
def test_unknown_keys_are_rejected(where, path):
    args = minimal()
    where(args)
    message = config_error(args)
    assert f"{path}: Extra inputs are not permitted" in message


@pytest.mark.parametrize("bad", ["abc", HASH_A.upper(), HASH_A[:-1], "sk-demo-alpha-local-only"])
def test_bad_key_hash_is_rejected(bad):
    args = minimal()
    args["tenants"][0]["key_hashes"] = [bad]
    message = config_error(args)
    assert "tenants.0.key_hashes" in message
    assert "SHA-256" in message


def test_tenant_needs_a_key_hash_unless_a_key_file_is_mounted():
    args = minimal()
    args["tenants"][0]["key_hashes"] = []
    assert "have no key_hashes and no key_hashes_file" in config_error(args)
    args["key_hashes_file"] = "/etc/forge/keys.yaml"
    assert load_config(args).tenants[0].key_hashes == []


def test_many_gateway_replicas_need_a_shared_store():
    args = minimal()
    args["gateway"] = {"deployment": {"num_replicas": 2}}
    assert "needs a shared store" in config_error(args)
    args["store"] = {"redis_url": "redis://127.0.0.1:6379/0"}
    assert load_config(args).store.resolved_url() == "redis://127.0.0.1:6379/0"


def test_store_url_from_the_environment_wins(monkeypatch):
    args = minimal()
    args["store"] = {"redis_url": "redis://config:6379", "redis_url_env": "FORGE_TEST_REDIS"}
    monkeypatch.setenv("FORGE_TEST_REDIS", "redis://env:6379")
    assert load_config(args).store.resolved_url() == "redis://env:6379"


GKE_YAML = LOCAL_YAML.parent / "gke.yaml"


def test_a_store_named_by_an_unset_variable_stops_start_up(monkeypatch):
    """Bug: an unset ``redis_url_env`` silently gave each gateway replica its own embedded
    store, so configs/gke.yaml's two gateways each enforced the whole budget."""
    monkeypatch.delenv("FORGE_REDIS_URL", raising=False)
    with GKE_YAML.open() as f:
        app = yaml.safe_load(f)["applications"][0]
    args = app["args"] | {"tenants": gateway_user_config(app)["tenants"]}
    args["key_hashes_file"] = None  # the mounted secret is not here; the store is the point
    args["tenants"][0]["key_hashes"] = [HASH_A]
    config = load_config(args)
    with pytest.raises(ConfigError, match="FORGE_REDIS_URL, which is not set"):
        build_store(config.store)
    monkeypatch.setenv("FORGE_REDIS_URL", "redis://127.0.0.1:6379/0")
    assert isinstance(build_store(config.store), GuardedStore)
    # The cache's own Memorystore, by its own variable: unset, start-up stops on it too.
    monkeypatch.delenv("FORGE_CACHE_REDIS_URL", raising=False)
    with pytest.raises(ConfigError, match=r"cache\.store\.redis_url_env names FORGE_CACHE_REDIS"):
        build_stores(config)
    monkeypatch.setenv("FORGE_CACHE_REDIS_URL", "redis://127.0.0.1:6379/1")
    stores = build_stores(config)
    assert stores.cache is not stores.main


def test_the_cache_shares_the_store_unless_it_names_a_redis_of_its_own():
    assert load_config(minimal()).cache.store is None
    args = minimal()
    args["cache"] = {"store": {}}
    message = config_error(args)
    assert "cache.store: Value error, cache.store needs redis_url or redis_url_env" in message
    args["cache"] = {"store": {"redis_url": "redis://cache:6379/0", "maxmemory": "1gb"}}
    assert "cache.store.maxmemory: Extra inputs are not permitted" in config_error(args)
    args["cache"] = {"store": {"redis_url": "redis://cache:6379/0", "background_timeout_s": 1}}
    assert "cache.store.background_timeout_s: Extra inputs" in config_error(args)  # main's only
    args["cache"] = {"store": {"redis_url_env": "FORGE_TEST_CACHE_REDIS", "timeout_s": 0.02}}
    store = load_config(args).cache.store
    assert store.shared and store.timeout_s == 0.02 and store.breaker.failure_threshold == 3


def test_the_embedded_store_only_when_no_store_is_configured(monkeypatch):
    monkeypatch.delenv("FORGE_TEST_REDIS", raising=False)
    assert isinstance(build_store(load_config(minimal()).store), MemoryStore)
    args = minimal()
    args["store"] = {"redis_url_env": "FORGE_TEST_REDIS"}
    with pytest.raises(ConfigError, match="FORGE_TEST_REDIS"):
        load_config(args).store.resolved_url()
    # Two gateways on a store named by a variable pass validation; start-up resolves it.
    args["gateway"] = {"deployment": {"num_replicas": 2}}
    assert load_config(args).store.shared


def test_limits_are_validated():
    args = minimal()
    args["tenants"][0]["limits"] = {"rpm": 0}
    assert "tenants.0.limits.rpm" in config_error(args)


def test_duplicate_tenant_names_rejected():
    args = minimal()
    args["tenants"].append({"name": "alpha", "key_hashes": [HASH_B]})
    assert "tenants: duplicate names ['alpha']" in config_error(args)


def test_duplicate_pool_models_rejected():
    args = minimal()
    args["pools"].append({"name": "second", "model": "m1"})
    assert "pools.model: duplicate names ['m1']" in config_error(args)


def test_duplicate_pool_names_rejected():
    args = minimal()
    args["pools"].append({"model": "m2"})  # both default to name "primary"
    assert "pools: duplicate names ['primary']" in config_error(args)


def test_key_hash_shared_by_two_tenants_rejected():
    args = minimal()
    args["tenants"].append({"name": "beta", "key_hashes": [HASH_B, HASH_A]})
    assert "one key hash is listed for two tenants" in config_error(args)


def test_rotation_two_hashes_for_one_tenant_accepted():
    args = minimal()
    args["tenants"][0]["key_hashes"] = [HASH_A, HASH_B]
    assert load_config(args).tenants[0].key_hashes == [HASH_A, HASH_B]


def test_pool_name_fallback_is_reserved():
    args = minimal()
    args["pools"][0]["name"] = "fallback"
    assert "'fallback' is reserved" in config_error(args)


def test_output_tokens_max_below_min_rejected():
    args = minimal()
    args["pools"][0]["engine"] = {"output_tokens_min": 10, "output_tokens_max": 5}
    message = config_error(args)
    assert "pools.0.engine" in message
    assert "output_tokens_max must be >= output_tokens_min" in message


def test_fallback_base_url_must_be_http():
    args = copy.deepcopy(minimal())
    args["fallback"] = {"base_url": "ftp://x", "model": "g"}
    assert "fallback.base_url" in config_error(args)


def test_fallback_auth_defaults_from_api_key_env():
    args = copy.deepcopy(minimal())
    args["fallback"] = {"base_url": "https://x/v1/", "model": "g"}
    assert load_config(args).fallback.auth == "none"
    args["fallback"]["api_key_env"] = "KEY"
    assert load_config(args).fallback.auth == "api_key"


@pytest.mark.parametrize(
    ("fallback", "expected"),
    [
        ({"auth": "api_key"}, "auth 'api_key' needs api_key_env"),
        ({"auth": "gcp_metadata", "api_key_env": "KEY"}, "only used with auth 'api_key'"),
        ({"auth": "oauth"}, "fallback.auth"),
        ({"auth": "gcp_metadata", "metadata_url": "metadata.google.internal"}, "metadata_url"),
    ],
)
def test_fallback_auth_mistakes_are_named(fallback, expected):
    args = copy.deepcopy(minimal())
    args["fallback"] = {"base_url": "https://x/v1/", "model": "g", **fallback}
    message = config_error(args)
    assert "fallback" in message and expected in message


def test_config_is_frozen():
    config = load_config(minimal())
    with pytest.raises(ValueError):
        config.pools[0].default_max_tokens = 1


def test_a_retry_floor_below_the_breaker_threshold_is_refused_naming_both():
    """At low traffic the floor is the whole budget: it must cover the failures that open a
    breaker, or the first seconds of every outage reach clients as 502s."""
    args = minimal() | {
        "resilience": {"breaker": {"failure_threshold": 5}, "retry_budget": {"min_retries": 3}}
    }
    message = config_error(args)
    assert "retry_budget.min_retries (3)" in message and "failure_threshold (5)" in message
    args["resilience"]["retry_budget"]["min_retries"] = 5
    assert load_config(args).resilience.retry_budget.min_retries == 5


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"bound": "latency"}, "bound must be 'requests' or 'tokens'"),
        ({"load_factor": 0.5}, "load_factor must be >= 1"),
        ({"prefix_blocks": 4}, "unexpected keyword argument 'prefix_blocks'"),
        ({"route_blocks": 0}, "route_blocks must be an integer >= 1"),
    ],
)
def test_a_routing_option_the_policy_refuses_fails_the_config_not_the_router(options, named):
    args = minimal()
    args["pools"][0]["routing"] = {"policy": "kv_aware", "options": options}
    message = config_error(args)
    assert "pools.0.routing" in message and named in message


def test_the_routing_options_the_policy_takes_pass():
    args = minimal()
    args["pools"][0]["routing"] = {
        "policy": "kv_aware",
        "options": {"bound": "tokens", "load_factor": 1.25, "route_blocks": 64},
    }
    assert load_config(args).pools[0].routing.options["bound"] == "tokens"


def test_a_pool_in_its_own_application_keeps_only_the_gateways_part_here():
    from serve_app.config.models import load_pool_app_config

    args = minimal()
    args["pools"][0] |= {"app": "forge-pool-primary", "admission": {"max_inflight": 4}}
    assert load_config(args).pools[0].app == "forge-pool-primary"
    for field in ("engine", "routing", "deployment"):
        wrong = copy.deepcopy(args)
        wrong["pools"][0][field] = {}
        assert f"{field}: set in the args of application 'forge-pool-primary'" in config_error(
            wrong
        )
    twice = copy.deepcopy(args)
    twice["pools"].append({"name": "second", "model": "m2", "app": "forge-pool-primary"})
    assert "pools.app: duplicate names ['forge-pool-primary']" in config_error(twice)
    # The pool's own application: the pool runs there, so it names no other application.
    assert load_pool_app_config({"pool": {"model": "m1"}}).pool.model == "m1"
    with pytest.raises(ConfigError, match=r"pool\.app: this application is where the pool runs"):
        load_pool_app_config({"pool": {"model": "m1", "app": "elsewhere"}})


def test_the_shipped_configs_run_every_pool_in_an_application_of_its_own():
    """So a pool's engine change rolls that pool alone (docs/architecture.md says why)."""
    for path in (LOCAL_YAML, GKE_YAML):
        document = yaml.safe_load(path.read_text())
        gateway = next(a for a in document["applications"] if a["name"] == "forge")
        assert all(pool.get("app") for pool in gateway["args"]["pools"]), path.name
        config = serve_config_forge(document)
        assert all(pool.app is None and pool.engine.kind for pool in config.pools)


# -- LoRA adapters -------------------------------------------------------------------------


def adapter_args(**tenant) -> dict:
    args = minimal()
    args["pools"][0]["adapters"] = [{"name": "support", "path": "/weights/support"}]
    args["tenants"][0].update(tenant)
    return args


def test_a_pools_adapters_and_a_tenants_binding_validate():
    config = load_config(adapter_args(adapters={"m1": "support"}, models=["m1", "m1:support"]))
    assert config.pools[0].adapter("support").path == "/weights/support"
    assert config.tenants[0].adapters == {"m1": "support"}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda a: a["tenants"][0].update(adapters={"m1": "nope"}), "tenants.0.adapters.m1"),
        (lambda a: a["tenants"][0].update(adapters={"m2": "support"}), "tenants.0.adapters.m2"),
        (lambda a: a["tenants"][0].update(models=["m1:nope"]), "tenants.0.models"),
        (lambda a: a["pools"][0]["adapters"].append({"name": "support", "path": "x"}), "duplicate"),
        (lambda a: a["pools"][0]["adapters"][0].update(name="a:b"), "pools.0.adapters.0.name"),
        (lambda a: a["pools"][0]["adapters"][0].update(tenants=["ghost"]), "adapters.0.tenants"),
        (lambda a: a["pools"][0].update(task="embed", fallback=False), "generation pools only"),
        (lambda a: a["pools"][0].update(engine={"max_loras": 0}), "pools.0.engine.max_loras"),
        (
            lambda a: a.update(
                models=[
                    {
                        "name": "alias",
                        "variants": [{"name": "v", "pool": "primary", "adapter": "x"}],
                    }
                ]
            ),
            "models.0.variants.0.adapter",
        ),
    ],
)
def test_a_bad_adapter_field_is_named(change, named):
    args = adapter_args()
    change(args)
    assert named in config_error(args)


def test_vllm_max_lora_rank_is_one_of_vllms_choices():
    args = adapter_args()
    args["pools"][0]["engine"] = {"kind": "vllm", "model": "/m", "max_lora_rank": 12}
    assert "pools.0.engine.max_lora_rank" in config_error(args)


@pytest.mark.parametrize(
    "where",
    [
        lambda a: a.setdefault("store", {}).update(redis_url_env="redis://:s3cret@h:6379/0"),
        lambda a: a.setdefault("metering", {}).update(
            database_url_env="postgresql://forge:s3cret@db:5432/usage"  # pragma: allowlist secret
        ),
    ],
    ids=["store", "ledger"],
)
def test_a_url_where_a_variable_name_belongs_is_refused_unechoed(where):
    """It would be looked up as a variable, found unset, and echoed, password and all."""
    args = minimal()
    where(args)
    message = config_error(args)
    assert "expected the name of an environment variable" in message and "a URL" in message
    assert "s3cret" not in message


def test_a_variable_that_holds_no_url_of_its_kind_stops_start_up(monkeypatch):
    from serve_app.metering.ledger import build_book

    monkeypatch.setenv("FORGE_TEST_REDIS", "127.0.0.1:6379")
    args = minimal() | {"store": {"redis_url_env": "FORGE_TEST_REDIS"}}
    with pytest.raises(ConfigError, match="FORGE_TEST_REDIS, which does not hold a Redis URL"):
        load_config(args).store.resolved_url()
    monkeypatch.setenv("FORGE_TEST_LEDGER", "127.0.0.1:5432")
    with pytest.raises(ConfigError, match="FORGE_TEST_LEDGER, which does not hold a PostgreSQL"):
        build_book(MeteringConfig(database_url_env="FORGE_TEST_LEDGER"))


def test_a_default_max_tokens_the_window_cannot_hold_is_refused():
    """Every request without max_tokens was vLLM's 400 for a max_tokens the client never sent."""
    args = minimal()
    args["pools"][0] |= {"context_window": 2048, "default_max_tokens": 4096}
    assert "default_max_tokens (4096) is more than its context window (2048)" in config_error(args)
    args["pools"][0]["default_max_tokens"] = 1024
    load_config(args)


def test_two_ledgers_named_at_once_are_refused():
    args = minimal() | {"metering": {"database_url_env": "X", "sqlite_path": "/tmp/u.sqlite3"}}
    assert "name two ledgers" in config_error(args)


def test_a_chain_step_written_with_on_says_when():
    """YAML reads an unquoted ``on:`` as true: the message was "Keys should be strings"."""
    args = minimal()
    args["models"] = yaml.safe_load(
        """
        - name: chat
          variants: [{name: stable, pool: primary}]
          chain: [{pool: fallback, on: [breaker_open]}]
        """
    )
    assert "conditions go under 'when:' ('on:' is YAML's true" in config_error(args)


def test_an_alias_cannot_take_a_pool_that_refuses_the_fallback_to_it():
    """A pool's ``fallback: false`` held for its own name only: an alias chained to the
    fallback over it was served there (``x-forge-backend: fallback``)."""
    args = minimal()
    args["pools"][0] |= {"name": "private", "fallback": False}
    args["fallback"] = {"base_url": "http://upstream.test/v1", "model": "ext"}
    args["models"] = [
        {
            "name": "cheap",
            "variants": [{"name": "main", "pool": "private"}],
            "chain": [{"pool": "fallback"}],
        }
    ]
    assert "pool 'private' has fallback: false" in config_error(args)
    args["pools"][0]["fallback"] = True
    load_config(args)


def test_a_price_on_an_alias_is_refused():
    """The ledger records the model that served, never the name asked: an alias's price never
    matched a line, and `forge usage` said the served model had no price."""
    args = minimal()
    args["models"] = [{"name": "chat", "variants": [{"name": "main", "pool": "primary"}]}]
    args["metering"] = {"prices": {"chat": {"prompt_per_million": 1.0}}}
    assert "metering.prices.chat: 'chat' is a models: entry" in config_error(args)
    args["metering"] = {"prices": {"m1": {"prompt_per_million": 1.0}}}
    load_config(args)
