"""The gate's own rules, without a gateway: the verdict, the calibration rule, the prompt set."""

from __future__ import annotations

import io

import pytest

from evals import cli, gate, prompts
from evals.gate import Check, Failed, Skipped
from evals.profile import DEFAULT_PROFILE, Profile, calibration_verdict
from evals.target import Target


def target() -> Target:
    return Target(base_url="http://127.0.0.1:1", key="k", profile=Profile.load(DEFAULT_PROFILE))


async def outcomes_of(*runs) -> list[gate.Outcome]:
    checks = [Check(f"c{i}", run, "g") for i, run in enumerate(runs)]
    return await gate.run_checks(target(), checks, out=io.StringIO())


async def passes(t, served):
    served.saw("primary")
    return "fine"


async def skips(t, served):
    raise Skipped("not here")


async def fails(t, served):
    raise Failed("p95 too high")


async def crashes(t, served):
    raise KeyError("choices")


async def test_skips_do_not_fail_the_gate_but_a_failure_or_a_crash_does():
    assert gate.verdict(await outcomes_of(passes, skips))
    failed = await outcomes_of(passes, fails)
    assert not gate.verdict(failed)
    assert "DEPLOY GATE: FAIL" in gate.summary(failed)
    crashed = await outcomes_of(crashes)
    assert crashed[0].status == "FAIL" and "KeyError" in crashed[0].detail
    assert not gate.verdict([])  # nothing checked is not a pass


async def test_each_line_says_who_served():
    t = target()
    t.pool, t.pool_names = "primary", ["primary"]

    async def mixed(t, served):
        served.saw("primary")
        served.saw("fallback")
        served.saw("primary", "hit")

    (outcome,) = await gate.run_checks(t, [Check("mixed", mixed, "g")], out=io.StringIO())
    assert outcome.served_counts == {"primary": 1, "fallback": 1, "cache": 1}
    assert "primary:1" in gate.line(outcome) and "fallback:1" in gate.line(outcome)


@pytest.mark.parametrize(
    ("ttft", "tpot", "problems"),
    [
        (0.5, 0.05, 0),  # half of each threshold: accepted
        (0.4, 0.04, 0),  # exactly at the rule
        (0.12, 0.05, 1),  # the rollout seed's mistake: a baseline at 12 % cannot fail
        (1.2, 0.05, 1),  # a baseline already over the threshold fails healthy deploys
        (0.1, 0.01, 2),
    ],
)
def test_the_calibration_rule_refuses_thresholds_the_baseline_sits_far_below(ttft, tpot, problems):
    profile = Profile.model_validate(
        {
            "name": "t",
            "operating_point": {
                "streams": [{"name": "s", "rate": 1, "prompt_tokens": 8, "max_tokens": 8}]
            },
            "slo": {"ttft_p95_s": 1.0, "tpot_p95_s": 0.1},
        }
    )
    said = calibration_verdict(profile, {"ttft_p95_s": ttft, "tpot_p95_s": tpot})
    assert len(said) == problems, said


def test_the_shipped_profiles_meet_their_own_rule_at_their_recorded_baseline():
    for path in DEFAULT_PROFILE.parent.glob("*.yaml"):
        profile = Profile.load(path)
        baseline = profile.calibration.baseline
        if baseline is None:
            continue
        assert calibration_verdict(profile, baseline.model_dump()) == [], path


def test_the_prompt_set_has_twenty_prompts_with_unique_ids_and_the_gate_25_checks():
    prompt_set = prompts.load()
    assert len(prompt_set) >= 20
    assert any(p.get("stop") for p in prompt_set) and any(p.get("json") for p in prompt_set)
    names = [c.name for c in cli.all_checks()]
    assert len(names) >= 25 and len(set(names)) == len(names)


def test_without_a_key_the_gate_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.delenv("FORGE_EVAL_KEY", raising=False)
    assert cli.main(["--base-url", "http://127.0.0.1:1"]) == 2


def test_an_unreachable_forge_fails_the_gate(capsys):
    assert cli.main(["--base-url", "http://127.0.0.1:9", "--key", "k"]) == 1
    out = capsys.readouterr().out
    assert "cannot reach" in out and "DEPLOY GATE: FAIL" in out
