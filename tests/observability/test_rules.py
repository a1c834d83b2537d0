"""Forge's Prometheus rules: valid, tested, and documented.

``promtool`` (Prometheus' own checker; Debian: ``apt-get install prometheus``) validates the
rules and runs their unit tests in forge-rules.test.yaml; without it those two tests skip. The
rest reads the files: every alert carries its annotations and a runbook that exists, and the unit
tests see every alert fire and stay quiet and check every recording rule's value.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "observability" / "prometheus" / "forge-rules.yaml"
RULE_TESTS = ROOT / "observability" / "prometheus" / "forge-rules.test.yaml"
README = ROOT / "README.md"

SEVERITIES = {"page", "warn"}

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not on PATH (Debian/Ubuntu: apt-get install prometheus)",
)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=120, check=False
    )


def rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def alerts() -> list[dict]:
    return [rule for rule in rules() if "alert" in rule]


def recordings() -> list[str]:
    return [rule["record"] for rule in rules() if "record" in rule]


def unit_tests() -> list[dict]:
    return yaml.safe_load(RULE_TESTS.read_text())["tests"]


@needs_promtool
def test_promtool_accepts_the_rules():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_the_rules_pass_their_unit_tests():
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("alert", alerts(), ids=lambda rule: rule["alert"])
def test_every_alert_has_a_severity_annotations_and_a_runbook_that_exists(alert: dict):
    assert alert["labels"]["severity"] in SEVERITIES
    annotations = alert["annotations"]
    assert annotations["summary"].strip() and annotations["description"].strip()
    page, _, anchor = annotations["runbook"].partition("#")
    assert page == "README.md", "runbooks live in the README's headings for now"
    assert anchor in readme_anchors(), f"README.md has no heading #{anchor}"


def readme_anchors() -> set[str]:
    """GitHub's anchors: a heading lowercased, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.+?)\s*$", README.read_text(), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_the_unit_tests_see_every_alert_fire_and_stay_quiet():
    cases = [case for test in unit_tests() for case in test.get("alert_rule_test", [])]
    for alert in alerts():
        name = alert["alert"]
        seen = [bool(case["exp_alerts"]) for case in cases if case["alertname"] == name]
        assert True in seen, f"no test sees {name} fire"
        assert False in seen, f"no test sees {name} stay quiet"


def test_the_unit_tests_check_every_recording_rule_with_traffic_and_without():
    by_name = {test["name"]: test for test in unit_tests()}
    checked = [
        (test["name"], case["expr"])
        for test in unit_tests()
        for case in test.get("promql_expr_test", [])
    ]
    with_values = {expr for name, expr in checked if name != "no traffic"}
    assert set(recordings()) <= with_values
    # Series that do not move: every recording rule is checked, every alert stays quiet.
    quiet = by_name["no traffic"]
    assert {case["expr"] for case in quiet["promql_expr_test"]} >= set(recordings())
    assert {case["alertname"] for case in quiet["alert_rule_test"] if not case["exp_alerts"]} == {
        alert["alert"] for alert in alerts()
    }
