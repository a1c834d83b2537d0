"""The per-variant windows and the analysis' verdict, on an injected clock."""

from __future__ import annotations

from serve_app.config.traffic import ModelPolicy
from serve_app.traffic.watch import TrafficWatch
from tests.doubles import Clock

ANALYSIS = {"canary": "canary", "stable": "stable", "min_requests": 10, "window_s": 60}


def entry(**analysis) -> ModelPolicy:
    return ModelPolicy.model_validate(
        {
            "name": "chat",
            "variants": [
                {"name": "stable", "pool": "primary", "weight": 90},
                {"name": "canary", "pool": "canary", "weight": 10},
            ],
            "analysis": {**ANALYSIS, **analysis},
        }
    )


def fed(watch: TrafficWatch, variant: str, n: int, *, failed: int = 0, ttft_s: float = 0.1):
    for i in range(n):
        watch.observe("chat", variant, failed=i < failed, ttft_s=ttft_s, tpot_s=0.01)


def test_too_few_requests_hold_and_a_healthy_canary_promotes():
    watch = TrafficWatch(Clock())
    watch.retune([entry(auto_abort=False)])
    fed(watch, "stable", 30)
    fed(watch, "canary", 5)
    assert watch.verdict("chat").decision == "hold"
    fed(watch, "canary", 10, ttft_s=0.12)
    assert watch.verdict("chat").decision == "promote"


def test_a_worse_error_ratio_or_a_slower_p95_aborts_with_the_numbers():
    errors = TrafficWatch(Clock())
    errors.retune([entry(auto_abort=False)])
    fed(errors, "stable", 40, failed=1)
    fed(errors, "canary", 20, failed=4)  # 20 % against 2.5 %
    verdict = errors.verdict("chat")
    assert verdict.decision == "abort" and "error ratio 0.200 vs stable 0.025" in verdict.reasons[0]
    slow = TrafficWatch(Clock())
    slow.retune([entry(auto_abort=False, max_ttft_ratio=1.5)])
    fed(slow, "stable", 40, ttft_s=0.1)
    fed(slow, "canary", 20, ttft_s=0.2)
    assert slow.verdict("chat").decision == "abort"
    assert not slow.aborted  # judged, not acted on: auto_abort is off


def test_auto_abort_sets_the_canary_aside_and_a_changed_entry_lifts_it():
    watch = TrafficWatch(Clock())
    watch.retune([entry()])
    fed(watch, "stable", 40)
    fed(watch, "canary", 40, failed=40)
    assert watch.aborted == {("chat", "canary")}
    assert watch.status()["chat"]["weights"] == {"stable": 90.0, "canary": 0.0}
    watch.retune([entry()])  # the same entry again: the abort holds
    assert watch.aborted
    watch.retune([entry(min_requests=20)])
    assert not watch.aborted and watch.summary("chat")["canary"]["requests"] == 0


def test_outcomes_older_than_the_window_are_not_judged():
    clock = Clock()
    watch = TrafficWatch(clock)
    watch.retune([entry(auto_abort=False)])
    fed(watch, "canary", 20, failed=20)
    clock.advance(61)
    fed(watch, "canary", 10)
    summary = watch.summary("chat")["canary"]
    assert (summary["requests"], summary["errors"]) == (10, 0)
