"""Traffic policy's core without a gateway: where a name leads, how variants are drawn and
kept, the context window's routing, and the config's refusals (each with its field's path)."""

from __future__ import annotations

from collections import Counter

import pytest

from serve_app import errors
from serve_app.config.live import apply_live
from serve_app.config.models import ConfigError, load_config
from serve_app.traffic.policy import SESSION_HEADER, TrafficPolicy, place
from serve_app.traffic.watch import TrafficWatch

KEY_HASH = "0" * 64


def args(models: list[dict], **extra) -> dict:
    return {
        "tenants": [{"name": "alpha", "key_hashes": [KEY_HASH]}],
        "pools": [
            {"name": "primary", "model": "big", "engine": {"max_model_len": 1024}},
            {"name": "canary", "model": "big-v2"},
            {"name": "small", "model": "small", "context_window": 8192},
        ],
        "fallback": {"base_url": "http://upstream.test/v1", "model": "ext"},
        "models": models,
        **extra,
    }


SPLIT = {
    "name": "chat",
    "variants": [
        {"name": "stable", "pool": "primary", "weight": 90},
        {"name": "canary", "pool": "canary", "weight": 10},
    ],
}


def policy(*models: dict, watch: TrafficWatch | None = None) -> TrafficPolicy:
    return TrafficPolicy(load_config(args(list(models))), watch)


def draw(p: TrafficPolicy, tenant: str, body: dict | None = None, headers=None) -> str:
    return p.resolve("chat", tenant, body or {}, headers or {}).variant


def test_a_pools_own_model_keeps_its_route_pool_then_fallback():
    target = policy().resolve("big", "alpha", {}, {})
    assert [s.backend for s in target.steps] == ["primary", "fallback"]
    assert target.variant is None and target.pool_model == "big"


def test_ten_thousand_tenants_split_within_two_points_of_the_weights():
    p = policy(SPLIT)
    counts = Counter(draw(p, f"tenant-{i}") for i in range(10_000))
    assert abs(counts["canary"] / 10_000 - 0.10) <= 0.02
    assert abs(counts["stable"] / 10_000 - 0.90) <= 0.02


def test_a_tenant_stays_on_its_variant_and_a_raised_canary_keeps_everyone_it_had():
    at_10 = policy(SPLIT)
    raised = {
        **SPLIT,
        "variants": [
            {**SPLIT["variants"][0], "weight": 50},
            {**SPLIT["variants"][1], "weight": 50},
        ],
    }
    at_50 = policy(raised)
    tenants = [f"tenant-{i}" for i in range(2_000)]
    first = {t: draw(at_10, t) for t in tenants}
    assert all(draw(at_10, t) == first[t] for t in tenants)  # sticky: the same, every time
    on_canary = {t for t, v in first.items() if v == "canary"}
    assert on_canary and all(draw(at_50, t) == "canary" for t in on_canary)
    assert abs(sum(draw(at_50, t) == "canary" for t in tenants) / 2_000 - 0.5) <= 0.04


def test_a_conversation_stays_on_one_variant_through_its_turns():
    p = policy({**SPLIT, "sticky": "conversation"})
    seen = set()
    for i in range(200):
        opening = {"role": "user", "content": f"conversation {i}"}
        turns = [
            {"messages": [{"role": "system", "content": "be brief"}, opening]},
            {
                "messages": [
                    opening,
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "more"},
                ]
            },
        ]
        variants = {draw(p, "alpha", body) for body in turns}
        assert len(variants) == 1
        seen |= variants
        # A session header keeps a conversation whatever its text.
        by_session = {
            draw(
                p,
                "alpha",
                {"messages": [{"role": "user", "content": str(j)}]},
                {SESSION_HEADER: f"s{i}"},
            )
            for j in range(3)
        }
        assert len(by_session) == 1
    assert seen == {"stable", "canary"}


def test_an_aborted_canary_weighs_nothing_until_its_entry_changes():
    watch = TrafficWatch()
    config = load_config(args([SPLIT]))
    watch.retune(config.models)
    p = TrafficPolicy(config, watch)
    assert "canary" in {draw(p, f"t{i}") for i in range(200)}
    watch.aborted.add(("chat", "canary"))
    watch.version += 1
    assert {draw(p, f"t{i}") for i in range(200)} == {"stable"}
    changed = load_config(args([{**SPLIT, "sticky": "request"}]))
    watch.retune(changed.models)
    assert not watch.aborted


def test_a_prompt_too_long_for_the_pool_starts_on_the_chain_step_that_takes_it():
    chained = {
        "name": "chat",
        "variants": [{"name": "main", "pool": "primary"}],
        "chain": [
            {"pool": "small", "when": ["context_length", "overload"]},
            {"pool": "fallback", "when": ["error"]},
        ],
    }
    target = policy(chained).resolve("chat", "alpha", {}, {})
    assert place(target, 100, 100) is target  # fits the pool: nothing moves
    moved = place(target, 2000, 100)
    assert target.steps[moved.start].backend == "small" and moved.excluded == {"primary"}
    strict = {"name": "chat", "variants": [{"name": "main", "pool": "primary"}], "chain": []}
    with pytest.raises(errors.ForgeError) as refused:
        place(policy(strict).resolve("chat", "alpha", {}, {}), 2000, 100)
    assert refused.value.status == 400 and refused.value.code == "context_length_exceeded"


def test_a_prompt_that_fits_with_an_answer_that_does_not_is_placed_to_be_cut():
    """vLLM answers a max_tokens past what the prompt leaves of its window, to the window's
    end: a pool that takes the prompt serves it where no step takes both."""
    strict = {"name": "chat", "variants": [{"name": "main", "pool": "primary"}], "chain": []}
    target = policy(strict).resolve("chat", "alpha", {}, {})
    window = target.steps[0].context
    assert place(target, window - 10, 100) is target
    with pytest.raises(errors.ForgeError):
        place(target, window, 100)  # the prompt alone fills it
    # A conversation its replica may truncate goes to the pool, as if it fit.
    assert place(target, window * 2, 100, truncated=True) is target


@pytest.mark.parametrize(
    ("entry", "path"),
    [
        (
            {
                **SPLIT,
                "variants": [
                    {"name": "a", "pool": "primary", "weight": 90},
                    {"name": "b", "pool": "canary", "weight": 5},
                ],
            },
            "sum to 95",
        ),
        (
            {"name": "chat", "variants": [{"name": "a", "pool": "nope"}]},
            "models.0.variants.0.pool: no pool is named 'nope'",
        ),
        (
            {
                "name": "chat",
                "variants": [{"name": "a", "pool": "primary"}],
                "chain": [{"pool": "small"}, {"pool": "small"}],
            },
            "models.0.chain.1.pool: 'small' comes back",
        ),
        (
            {
                "name": "chat",
                "variants": [{"name": "a", "pool": "primary"}],
                "chain": [{"pool": "primary"}],
            },
            "models.0.chain.0.pool: 'primary' comes back",
        ),
        (
            {"name": "big", "variants": [{"name": "a", "pool": "primary"}]},
            "models.0.name: 'big' is a pool's model",
        ),
        (
            {**SPLIT, "analysis": {"canary": "nope", "stable": "stable"}},
            "analysis.canary: no variant is named 'nope'",
        ),
        (
            {
                "name": "chat",
                "variants": [{"name": "a", "pool": "primary"}],
                "shadow": {"pool": "gone", "percent": 5},
            },
            "models.0.shadow.pool: no pool is named 'gone'",
        ),
    ],
)
def test_a_bad_entry_is_refused_at_start_and_live_naming_its_field(entry: dict, path: str):
    with pytest.raises(ConfigError, match=path.replace("(", r"\(")):
        load_config(args([entry]))
    with pytest.raises(ConfigError, match=path.replace("(", r"\(")):
        apply_live(load_config(args([])), {"tenants": args([])["tenants"], "models": [entry]})


def test_a_tenants_allow_list_must_name_served_models():
    bad = args([SPLIT])
    bad["tenants"][0]["models"] = ["chat", "gpt-9"]
    with pytest.raises(ConfigError, match=r"tenants.0.models: no model is named \['gpt-9'\]"):
        load_config(bad)


# -- LoRA adapters ---------------------------------------------------------------------------


def test_an_adapters_request_takes_only_the_steps_that_have_its_adapter():
    chained = {
        "name": "chat",
        "variants": [{"name": "main", "pool": "primary"}],
        "chain": [{"pool": "canary"}, {"pool": "fallback"}],
    }
    config_args = args([chained])
    config_args["pools"][0]["adapters"] = [{"name": "acme", "path": "/w/acme"}]
    config_args["pools"][1]["adapters"] = [{"name": "acme", "path": "/w/acme-v2"}]
    config_args["tenants"][0]["adapters"] = {"big": "acme"}
    config = load_config(config_args)
    policy = TrafficPolicy(config)
    (tenant,) = config.tenants
    # Bound to acme on "big": its alias's route keeps the pools that have acme, not the fallback.
    target = policy.bind(policy.resolve("chat", "alpha", {}, {}), tenant)
    assert target.adapter == "acme"
    assert target.excluded == {"fallback"}
    # By name, for a tenant bound to nothing: the pool, never the fallback.
    unbound = config.tenants[0].model_copy(update={"adapters": {}})
    target = policy.bind(policy.resolve("big:acme", "alpha", {}, {}), unbound)
    assert (target.adapter, target.excluded) == ("acme", {"fallback"})
    # The base model itself, unbound: as before.
    assert policy.bind(policy.resolve("big", "alpha", {}, {}), unbound).adapter is None
