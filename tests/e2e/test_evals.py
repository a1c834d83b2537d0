"""The eval gate (``python -m evals``) against the session's graph: it passes a healthy Forge, it
passes with the primary pool failing and every answer the fallback's (and says so per check), and
it fails when neither the primary nor a fallback can answer. Its Redis-loss drill pauses the
session's private Redis for a few seconds.

The whole gate, failover drill and SLO run included, runs in CI against ``serve run
configs/local.yaml`` (``.ci/run``); here the drills that need a second gateway replica and Redis."""

from __future__ import annotations

import io

import pytest
import yaml

from evals import cli, gate, slo
from evals.profile import Profile
from evals.target import Target
from tests.e2e.conftest import ADMIN_KEY, tenant_key

# Small numbers: the suite shares two cores with the whole graph.
PROFILE = {
    "name": "e2e",
    "operating_point": {
        "duration_s": 4,
        "warmup_s": 0.5,
        "streams": [{"name": "s", "rate": 4, "prompt_tokens": 64, "max_tokens": 16}],
    },
    "slo": {"ttft_p95_s": 5.0, "tpot_p95_s": 1.0},
    # Calibrated at a quarter of each threshold, not the shipped half: the slow run shares the two
    # cores with another slow drill (a replica starting, a hung one), and a p95 over 16 requests is
    # their slowest one. At the half, CI failed a healthy graph on one 134 ms TTFT (baseline 60 ms).
    # What this test proves is the operator's sequence, not the latency (a benchmark's claim).
    "calibration": {"min_baseline_ratio": 0.2, "target_ratio": 0.25},
    # The victim's bound is generous on purpose: on two cores shared with the flood's own client
    # and the whole graph a 16-token victim took up to 6.2 s (load average 18, CI). What the
    # check is for here, the victim served while the flood is shed with 429s, does not need a
    # tight bound; the latency claim is a benchmark (docs/benchmarks.md, fair admission).
    "isolation": {"flood_rate": 20, "flood_s": 4, "victim_requests": 5, "victim_total_s": 15.0},
    "failover": {"rate": 4, "fault_after_s": 1, "fault_for_s": 4, "home_within_s": 10},
    "oversize_bytes": 256 * 1024,  # the session's gateways take 64 KiB
    "disconnect_streams": 3,
}
# Everything but the drills that fault or flood the shared pool (the slow test runs those).
QUICK = ("protocol:", "prompt:", "cache:", "metering:", "quota:", "disconnect:", "store:")


def gate_target(forge_url: str, redis_server, **overrides) -> Target:
    return Target(
        base_url=forge_url,
        key=tenant_key("gate"),
        profile=Profile.model_validate(PROFILE),
        admin_key=ADMIN_KEY,
        flood_key=tenant_key("flood"),
        quota_key=tenant_key("gate-quota"),
        redis_url=redis_server.url if redis_server else None,
        **{"model": "forge-sim", **overrides},
    )


async def run_gate(target: Target, only=QUICK) -> tuple[list[gate.Outcome], str]:
    checks = [c for c in cli.all_checks() if c.name.startswith(only)]
    out = io.StringIO()
    await target.discover()
    outcomes = await gate.run_checks(target, checks, out=out)
    return outcomes, out.getvalue()


def by_name(outcomes: list[gate.Outcome]) -> dict[str, gate.Outcome]:
    return {o.name: o for o in outcomes}


async def test_the_gate_passes_a_healthy_forge_and_drills_redis_loss(forge_url, redis_server):
    target = gate_target(forge_url, redis_server)
    outcomes, printed = await run_gate(target)
    assert gate.verdict(outcomes), printed
    assert target.primary_serving and target.pool == "primary"
    named = by_name(outcomes)
    assert named["cache:repeat-is-a-hit"].detail == "miss, hit, hit as SSE"
    assert named["prompt:json-schema"].served == "primary"
    assert named["disconnect:slots-and-caps-freed"].status == "PASS", printed
    for route in ("protocol:responses-api", "protocol:messages-api"):  # a check per API
        assert named[route].status == "PASS" and named[route].served == "primary", printed
    redis_loss = named["store:redis-loss-fails-open"]
    if redis_server is None:
        assert redis_loss.status == "SKIP" and "embedded" in redis_loss.detail
    else:
        assert redis_loss.status == "PASS", printed
        assert "store errors counted" in redis_loss.detail


async def test_behind_an_admin_listener_the_gate_checks_the_admin_routes_are_off_the_clients(
    split_fronts,
):
    clients, operator = split_fronts
    target = gate_target(clients, None, admin_url=operator)
    outcomes, printed = await run_gate(target, only=("protocol:",))
    assert gate.verdict(outcomes), printed
    named = by_name(outcomes)
    assert named["protocol:admin-off-clients-port"].status == "PASS", printed
    assert named["protocol:tenant-on-admin-403"].status == "PASS", printed
    assert target.pool == "primary"  # found through the admin listener's /admin/status


async def test_with_the_primary_failing_the_fallback_answers_every_check(forge_url, faults):
    faults.set_all("pool-chaos", {"mode": "error"})
    target = gate_target(forge_url, None, model="forge-chaos")
    outcomes, printed = await run_gate(target, only=("protocol:", "prompt:", "cache:"))
    assert not target.primary_serving
    assert gate.verdict(outcomes), printed
    prompt_checks = [o for o in outcomes if o.name.startswith("prompt:")]
    assert len(prompt_checks) >= 20
    assert all(o.served == "fallback" for o in prompt_checks), printed
    assert "not cached" in by_name(outcomes)["cache:repeat-is-a-hit"].detail


async def test_with_neither_the_primary_nor_a_fallback_the_gate_fails(forge_url, faults):
    faults.set_all("pool-solo", {"mode": "error"})  # the solo pool has no fallback
    target = gate_target(forge_url, None, model="forge-solo")
    outcomes, printed = await run_gate(target, only=("prompt:greeting", "prompt:capital"))
    assert not gate.verdict(outcomes), printed
    assert all(o.status == "FAIL" for o in outcomes)
    assert "DEPLOY GATE: FAIL" in gate.summary(outcomes)


@pytest.mark.slow
async def test_the_whole_gate_calibrated_then_run_failover_and_isolation_included(
    forge_url, redis_server, tmp_path
):
    """The operator's sequence: calibrate the profile here, then gate on it."""
    profile = tmp_path / "e2e.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    target = gate_target(forge_url, redis_server)
    await target.discover()
    assert await slo.calibrate(target, profile, write=True, command="pytest") == 0
    target.profile = Profile.load(profile)
    assert target.profile.calibration.baseline is not None
    outcomes, printed = await run_gate(target, only=("",))
    assert gate.verdict(outcomes), printed
    named = by_name(outcomes)
    assert named["failover:drill"].status == "PASS", printed
    assert named["isolation:victim-within-slo"].status == "PASS", printed
    for metric in ("ttft_p95", "tpot_p95"):  # judged against the thresholds calibration wrote
        threshold = getattr(target.profile.slo, f"{metric}_s")
        assert threshold < PROFILE["slo"][f"{metric}_s"], printed
        assert named[f"slo:{metric}"].status == "PASS", printed
        assert f"<= {threshold:.4f} s" in named[f"slo:{metric}"].detail, printed
