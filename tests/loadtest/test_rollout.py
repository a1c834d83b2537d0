"""The rollout drill's own logic without a graph: each phase changes what it says and nothing
else, replicas are compared by id and PID, and ``--check`` fails what it should."""

from __future__ import annotations

import yaml
from ray.serve.schema import ServeDeploySchema

from loadtest import rollout
from serve_app.config.live import application_config, serve_config_forge

BASE = yaml.safe_load(open(rollout.REPO / rollout.CONFIG))


def forge(config: dict, name: str = "forge") -> dict:
    return next(a for a in config["applications"] if a["name"] == name)


def pool_app(config: dict) -> dict:
    return forge(config, rollout.POOL_APP)


def test_the_tenant_phase_changes_only_the_gateways_user_config():
    changed = rollout.variant(BASE, "tenant")
    assert forge(changed)["args"] == forge(BASE)["args"]
    config = application_config(forge(changed))
    assert [t.name for t in config.tenants] == ["alpha", "beta", "gamma"]
    assert config.tenants[1].limits.rpm == 600
    assert forge(BASE)["deployments"] != forge(changed)["deployments"]


def test_the_gateway_phase_changes_only_the_gateways_args():
    changed = rollout.variant(BASE, "gateway")
    assert forge(changed)["deployments"] == forge(BASE)["deployments"]
    differs = [
        k for k in forge(BASE)["args"] if forge(BASE)["args"][k] != forge(changed)["args"][k]
    ]
    assert differs == ["gateway"] and pool_app(changed) == pool_app(BASE)
    serve_config_forge(changed)  # still valid


def test_the_pool_phase_changes_only_the_pools_own_application():
    changed = rollout.variant(BASE, "pool")
    assert forge(changed) == forge(BASE)
    before, after = pool_app(BASE)["args"]["pool"], pool_app(changed)["args"]["pool"]
    assert [k for k in before if before[k] != after[k]] == ["engine"]
    assert serve_config_forge(changed).pools[0].engine != serve_config_forge(BASE).pools[0].engine


def test_the_pool_options_phase_changes_only_the_pools_deployment_entry():
    changed = rollout.variant(BASE, "pool-options")
    assert forge(changed) == forge(BASE)
    assert pool_app(changed)["args"] == pool_app(BASE)["args"]
    (entry,) = pool_app(changed)["deployments"]
    assert entry == {"name": "pool-primary", "ray_actor_options": {"num_cpus": 0.01}}
    ServeDeploySchema.model_validate(changed)


def test_check_fails_a_pool_options_change_that_replaced_more_than_the_pool():
    row = {"phase": "pool-options", "truncated": 0, "errors": 0, "note": ""}
    assert rollout.problems([{**row, "replaced": {"pool-primary": 2}}]) == []
    assert rollout.problems([{**row, "replaced": {"pool-primary": 2, "gateway": 1}}])
    assert rollout.problems([{**row, "replaced": {}}])


def test_replicas_are_the_same_only_with_the_same_id_and_pid():
    before = {"gateway": {"a": (1, "RUNNING")}, "pool": {"b": (2, "RUNNING"), "c": (3, "RUNNING")}}
    after = {"gateway": {"a": (1, "RUNNING")}, "pool": {"b": (9, "RUNNING"), "d": (4, "RUNNING")}}
    replaced, kept = rollout.compare(before, after)
    assert replaced == {"gateway": 0, "pool": 2} and kept == {"gateway": 1, "pool": 0}


def test_check_fails_a_live_change_that_replaced_a_replica_or_lost_a_request():
    ok = {"phase": "tenant", "truncated": 0, "errors": 0, "replaced": {}, "note": "served"}
    assert rollout.problems([ok]) == []
    assert rollout.problems([{**ok, "replaced": {"gateway": 1}}])
    assert rollout.problems([{**ok, "phase": "pool", "truncated": 1}])
    assert rollout.problems([{**ok, "phase": "refused", "note": "configuration kept: False"}])


def test_check_fails_a_gateway_change_that_replaced_the_control_or_lost_a_budget_or_breaker():
    ok = {
        "phase": "gateway",
        "truncated": 0,
        "errors": 0,
        "replaced": {"gateway": 1},
        "slots": {"max_used": 16, "total": 16, "samples": 40},
        "breaker_before": "open",
        "note": "slots used at most 16 of 16 (40 samples); embed's breaker open after the roll",
    }
    assert rollout.problems([ok]) == []
    scheduler = f"{rollout.CONTROL_APP}/scheduler-primary"
    assert rollout.problems([{**ok, "replaced": {"gateway": 1, scheduler: 1}}])
    assert rollout.problems([{**ok, "slots": {"max_used": 17, "total": 16, "samples": 40}}])
    assert rollout.problems([{**ok, "slots": {"max_used": 0, "total": 0, "samples": 0}}])
    assert rollout.problems([{**ok, "note": "embed's breaker closed after the roll"}])
    assert rollout.problems([{**ok, "breaker_before": "closed"}])
