"""The canary analysis' answer from a gateway's ``traffic`` status (``evals/canary.py``); the
run against a live graph is ``python -m loadtest.traffic_policy`` (CI's documented commands)."""

from __future__ import annotations

from evals import canary

WINDOW = {"requests": 40, "errors": 0, "error_ratio": 0.0, "ttft_p50_s": 0.05}
ANALYSIS = {
    "canary": "canary",
    "stable": "stable",
    "min_requests": 20,
    "max_error_ratio_increase": 0.05,
    "max_ttft_ratio": 1.5,
}


def entry(decision: str, aborted: list[str], canary_errors: int = 0) -> dict:
    faulty = {**WINDOW, "errors": canary_errors, "error_ratio": canary_errors / 40}
    windows = {
        "stable": {**WINDOW, "ttft_p95_s": 0.06, "tpot_p95_s": 0.01},
        "canary": {**faulty, "ttft_p95_s": 0.07, "tpot_p95_s": None},
    }
    return {
        "weights": {"stable": 90.0, "canary": 0.0 if aborted else 10.0},
        "aborted": aborted,
        "variants": windows,
        "verdict": {"decision": decision, "reasons": ["why"], **windows},
        "analysis": ANALYSIS,
    }


def test_the_verdict_is_told_with_each_variants_numbers():
    decision, lines = canary.judged(entry("promote", []), 300)
    assert decision == "promote" and lines[-1] == "CANARY: PROMOTE"
    assert any("canary: 40 requests, error ratio 0.000, p95 TTFT 70.0 ms" in line for line in lines)
    assert canary.EXIT[decision] == 0


def test_a_canary_the_gateway_already_aborted_is_an_abort_whatever_its_window_says():
    # Aborted, it gets no traffic: its window ages into "too few requests", a hold.
    decision, lines = canary.judged(entry("hold", ["canary"], canary_errors=12), 300)
    assert decision == "abort" and canary.EXIT[decision] == 1
    assert "aborted by the gateway: ['canary'] (weight 0)" in "\n".join(lines)
    assert canary.EXIT[canary.judged(entry("hold", []), 10)[0]] == 3
