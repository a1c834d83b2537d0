"""How each variant of a model is doing, and the analysis that may abort a canary.

Per (model, variant), this gateway replica keeps the last ``window_s`` of outcomes: whether the
variant failed the request (a 5xx, or its pool failed it before another step served it) and,
when its own pool answered, the time to first byte and per output token. ``summary`` is what
``/admin/status`` shows and ``python -m evals canary`` reads; ``verdict`` compares a canary with
its stable variant under the same traffic. With ``analysis.auto_abort``, a canary whose verdict
is abort weighs 0 from then on (``policy.TrafficPolicy`` reads ``aborted``) until its model's
entry changes. Each gateway replica judges on what it saw; with several, each aborts on its own
evidence, and the analysis reads them all (``evals/canary.py``).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from serve_app.config.traffic import AnalysisConfig, ModelPolicy

logger = logging.getLogger("ray.serve")

_MAX_KEPT = 20_000  # outcomes per variant, whatever the window
# The analysis runs at most once a second, and at least every so many outcomes of a model.
_JUDGE_EVERY_S = 1.0
_JUDGE_EVERY_N = 20


@dataclass(frozen=True, slots=True)
class Outcome:
    at: float
    failed: bool
    ttft_s: float | None
    tpot_s: float | None


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: str  # "promote", "hold" or "abort"
    reasons: tuple[str, ...]
    canary: dict
    stable: dict

    def as_dict(self) -> dict:
        return {
            "decision": self.decision,
            "reasons": list(self.reasons),
            "canary": self.canary,
            "stable": self.stable,
        }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(outcomes: Iterable[Outcome]) -> dict:
    kept = list(outcomes)
    ttft = [o.ttft_s for o in kept if o.ttft_s is not None]
    tpot = [o.tpot_s for o in kept if o.tpot_s is not None]
    failed = sum(o.failed for o in kept)
    return {
        "requests": len(kept),
        "errors": failed,
        "error_ratio": failed / len(kept) if kept else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p95_s": percentile(ttft, 0.95),
        "tpot_p95_s": percentile(tpot, 0.95),
    }


def judge(analysis: AnalysisConfig, canary: dict, stable: dict) -> Verdict:
    """Abort on a worse error ratio or a slower p95 TTFT than the stable variant allows; hold
    while either has too few requests to tell; promote otherwise."""
    reasons = []
    if canary["requests"] < analysis.min_requests or stable["requests"] < analysis.min_requests:
        reasons.append(
            f"too few requests to tell ({canary['requests']} canary, {stable['requests']} "
            f"stable; {analysis.min_requests} each needed)"
        )
        return Verdict("hold", tuple(reasons), canary, stable)
    increase = canary["error_ratio"] - stable["error_ratio"]
    if increase > analysis.max_error_ratio_increase:
        reasons.append(
            f"error ratio {canary['error_ratio']:.3f} vs stable {stable['error_ratio']:.3f} "
            f"(+{increase:.3f} > {analysis.max_error_ratio_increase})"
        )
    c_ttft, s_ttft = canary["ttft_p95_s"], stable["ttft_p95_s"]
    if c_ttft is not None and s_ttft:
        ratio = c_ttft / s_ttft
        if ratio > analysis.max_ttft_ratio:
            reasons.append(
                f"p95 TTFT {c_ttft * 1000:.1f} ms vs stable {s_ttft * 1000:.1f} ms "
                f"({ratio:.2f}x > {analysis.max_ttft_ratio}x)"
            )
    if reasons:
        return Verdict("abort", tuple(reasons), canary, stable)
    return Verdict("promote", ("within every bound",), canary, stable)


class TrafficWatch:
    """Per-variant windows of one gateway replica, kept across live changes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._outcomes: dict[tuple[str, str], deque[Outcome]] = {}
        self._policies: dict[str, ModelPolicy] = {}
        self.aborted: set[tuple[str, str]] = set()
        self.version = 0  # bumped with every change of ``aborted``
        self._judged_at: dict[str, tuple[float, int]] = {}  # model → (when, outcomes since)

    def retune(self, policies: Iterable[ModelPolicy]) -> None:
        """A live change: an entry that changed (its weights, its variants) starts over, its
        abort lifted; an unchanged one keeps its window and its abort."""
        new = {p.name: p for p in policies}
        for name, old in list(self._policies.items()):
            if new.get(name) != old:
                self._forget(name)
        self._policies = new

    def _forget(self, model: str) -> None:
        for key in [k for k in self._outcomes if k[0] == model]:
            del self._outcomes[key]
        if any(k[0] == model for k in self.aborted):
            self.aborted = {k for k in self.aborted if k[0] != model}
            self.version += 1

    def observe(
        self,
        model: str,
        variant: str,
        *,
        failed: bool,
        ttft_s: float | None,
        tpot_s: float | None,
    ) -> None:
        now = self._clock()
        window = self._outcomes.get((model, variant))
        if window is None:
            window = self._outcomes[(model, variant)] = deque(maxlen=_MAX_KEPT)
        window.append(Outcome(now, failed, ttft_s, tpot_s))
        policy = self._policies.get(model)
        if policy is not None and policy.analysis is not None and policy.analysis.auto_abort:
            when, since = self._judged_at.get(model, (-math.inf, 0))
            if now - when >= _JUDGE_EVERY_S or since + 1 >= _JUDGE_EVERY_N:
                self._judged_at[model] = (now, 0)
                self._maybe_abort(policy, policy.analysis)
            else:
                self._judged_at[model] = (when, since + 1)

    def _maybe_abort(self, policy: ModelPolicy, analysis: AnalysisConfig) -> None:
        key = (policy.name, analysis.canary)
        if key in self.aborted:
            return
        verdict = self.verdict(policy.name)
        if verdict is not None and verdict.decision == "abort":
            self.aborted = self.aborted | {key}
            self.version += 1
            logger.warning(
                "traffic: canary %s of model %s aborted (weight 0): %s",
                analysis.canary,
                policy.name,
                "; ".join(verdict.reasons),
            )

    def summary(self, model: str) -> dict[str, dict]:
        """Each variant's window: requests, errors, error ratio, TTFT and TPOT percentiles."""
        policy = self._policies.get(model)
        window_s = policy.analysis.window_s if policy and policy.analysis else 60.0
        since = self._clock() - window_s
        variants = [v.name for v in policy.variants] if policy else []
        return {
            name: summarize(o for o in self._outcomes.get((model, name), ()) if o.at >= since)
            for name in variants
        }

    def verdict(self, model: str) -> Verdict | None:
        policy = self._policies.get(model)
        if policy is None or policy.analysis is None:
            return None
        summary = self.summary(model)
        return judge(
            policy.analysis, summary[policy.analysis.canary], summary[policy.analysis.stable]
        )

    def status(self) -> dict:
        """What ``/admin/status`` shows under ``traffic``."""
        out = {}
        for name, policy in self._policies.items():
            verdict = self.verdict(name)
            out[name] = {
                "weights": {
                    v.name: 0.0 if (name, v.name) in self.aborted else v.weight
                    for v in policy.variants
                },
                "aborted": sorted(v for m, v in self.aborted if m == name),
                "variants": self.summary(name),
                "verdict": verdict.as_dict() if verdict is not None else None,
                "analysis": policy.analysis.model_dump() if policy.analysis else None,
            }
        return out
