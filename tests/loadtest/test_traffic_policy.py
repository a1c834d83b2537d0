"""The traffic-policy drill's own parts: the graph it serves is a valid Serve config, and its
``--check`` fails the run it should (the drill itself runs in CI's documented commands)."""

from __future__ import annotations

import copy

import pytest

from loadtest import traffic_policy
from serve_app.config.live import serve_config_forge
from serve_app.config.models import ConfigError


def test_the_drills_graph_is_a_valid_config_with_its_pools_and_entries():
    config = serve_config_forge(traffic_policy.serve_config())
    assert {p.name for p in config.pools} >= {"primary", "canary", "small", "long"}
    assert [m.name for m in config.models] == ["chat", "chat-tenant", "big", "big-alone", "long"]
    raised = serve_config_forge(traffic_policy.serve_config(traffic_policy.RAISED_WEIGHT))
    assert raised.models[0].variants[1].weight == 50


PASSING = {
    "split": {
        "errors": 0,
        "canary_share": 0.101,
        "weight": 0.1,
        "served": 10,
        "answered_by_own_pool": 10,
    },
    "sticky": {
        "tenants": 50,
        "tenants_on_one_variant": 50,
        "conversations": 300,
        "conversations_on_one_variant": 300,
    },
    "live": {"served_in_s": 2.5, "replaced": {}, "canary_share_after": 0.5, "weight_after": 0.5},
    "overload": {
        "big-alone": {"429": 300, "p95_s": 1.2, "backends": {"primary": 300}},
        "big": {"429": 0, "p95_s": 0.8, "backends": {"primary": 290, "small": 310}},
    },
    "down": {"errors": 0, "backends": {"fallback": 60}},
    "context": {"long_prompt_backend": "long", "short_prompt_backend": "primary"},
    "shadow": {
        "errors": 0,
        "charged_tokens": 66,
        "answers_tokens": 66,
        "copies": {"chat/small/ok": 3},
    },
    "canary": {"healthy": "promote", "faulty": "abort", "aborted": ["canary"]},
}


def broken(path: str, value) -> dict:
    out = copy.deepcopy(PASSING)
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        node = node[key]
    node[leaf] = value
    return out


def test_check_passes_a_run_that_held_and_fails_each_broken_expectation():
    assert traffic_policy.problems(PASSING) == []
    for path, value, said in [
        ("split.canary_share", 0.125, "split"),
        ("live.replaced", {"pool-primary": 2}, "live"),
        ("overload.big.p95_s", 1.5, "overload"),
        ("shadow.charged_tokens", 70, "shadow"),
        ("canary.faulty", "hold", "canary"),
        ("context.long_prompt_backend", "primary", "context"),
    ]:
        found = traffic_policy.problems(broken(path, value))
        assert len(found) == 1 and found[0].startswith(said), (path, found)


def test_a_context_window_past_the_pool_applications_max_model_len_is_refused():
    config = traffic_policy.serve_config()
    (gateway,) = [a for a in config["applications"] if a["name"] == "forge"]
    (pool_app,) = [a for a in config["applications"] if a["name"] == "forge-pool-primary"]
    engine_len = pool_app["args"]["pool"]["engine"]["max_model_len"]
    primary = next(p for p in gateway["args"]["pools"] if p["name"] == "primary")
    primary["context_window"] = engine_len + 1
    with pytest.raises(ConfigError, match=rf"pools.0.context_window: {engine_len + 1} is more"):
        serve_config_forge(config)
