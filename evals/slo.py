"""The SLO gate at the profile's operating point, and its calibration.

One open-loop run (``loadtest/traffic.py``) at the operating point feeds four checks: p95 time to
first token, p95 time per output token, error ratio and truncation ratio. ``calibrate`` measures
the same run as a baseline and refuses thresholds the baseline sits far below (``profile.py``).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path

import yaml

from evals.gate import Check, Failed, Served
from evals.profile import LATENCY_METRICS, Baseline, Profile, calibration_verdict
from evals.target import Target
from loadtest import traffic

_LABELS = {
    "ttft_p95_s": "p95 TTFT",
    "tpot_p95_s": "p95 time per output token",
    "error_ratio": "error ratio",
    "truncation_ratio": "truncation ratio",
}


def operating_streams(profile: Profile, key: str, model: str | None) -> list[traffic.Stream]:
    """The profile's operating point as the load generator's streams, at ``model``."""
    return [
        traffic.Stream(
            name=s.name,
            key=key,
            rate=s.rate,
            prompt_tokens=s.prompt_tokens,
            max_tokens=s.max_tokens,
            model=model,
            headers={"cache-control": "no-store"},  # the engine's latency, not the cache's
        )
        for s in profile.operating_point.streams
    ]


async def measure(target: Target, profile: Profile) -> tuple[dict, list[traffic.Result]]:
    point = profile.operating_point
    streams = operating_streams(profile, target.key, target.model)
    results = await traffic.run(target.base_url, streams, point.duration_s, seed=7)
    judged = [r for r in results if r.start >= point.warmup_s]
    stats = traffic.summarize(judged)
    # Arrivals the client could not send (too many in flight: a stalled gateway) are errors here.
    arrivals = stats["requests"] + stats["dropped"]
    measured = {
        "ttft_p95_s": stats["ttft_p95_s"],
        "tpot_p95_s": stats["tpot_p95_s"],
        "error_ratio": (stats["errors"] + stats["dropped"]) / arrivals if arrivals else 0.0,
        "truncation_ratio": stats["truncation_ratio"],
        "requests": arrivals,
    }
    return measured, judged


class SloRun:
    """Runs the operating point once, on the first SLO check; the four checks read it."""

    def __init__(self) -> None:
        self.measured: dict | None = None
        self.results: list[traffic.Result] = []

    async def get(self, target: Target) -> dict:
        if self.measured is None:
            self.measured, self.results = await measure(target, target.profile)
        return self.measured

    def check(self, metric: str) -> Check:
        async def run(target: Target, served: Served) -> str:
            if metric in LATENCY_METRICS:
                _require_calibrated(target.profile)
            measured = await self.get(target)
            for r in self.results:
                served.saw(r.backend, r.cache)
            threshold = getattr(target.profile.slo, metric)
            value = measured[metric]
            if value is None:
                raise Failed(f"no {_LABELS[metric]} measured ({measured['requests']} requests)")
            unit = " s" if metric in LATENCY_METRICS else ""
            said = f"{value:.4f}{unit} <= {threshold:.4f}{unit}"
            if value > threshold:
                raise Failed(f"{_LABELS[metric]} {value:.4f}{unit} > {threshold:.4f}{unit}")
            return f"{said} over {measured['requests']} requests"

        return Check(f"slo:{metric.removesuffix('_s')}", run, "slo")


def _require_calibrated(profile: Profile) -> None:
    """A latency threshold counts only with a baseline that meets the rule: one edited by hand
    far above its baseline (or never measured) is a gate that cannot fail."""
    baseline = profile.calibration.baseline
    if baseline is None:
        raise Failed(
            f"profile {profile.name} is not calibrated: run `python -m evals calibrate "
            f"--profile <its file> --write` against this deployment at its operating point"
        )
    problems = calibration_verdict(profile, baseline.model_dump())
    if problems:
        raise Failed("thresholds refused by the calibration rule: " + "; ".join(problems))


def checks() -> list[Check]:
    run = SloRun()
    return [run.check(metric) for metric in _LABELS]


def write_thresholds(path: Path, profile: Profile, measured: dict, command: str) -> Profile:
    """Each latency threshold at baseline / target ratio, and the baseline, into the file."""
    data = yaml.safe_load(path.read_text())  # the file's comments: only the header survives
    ratio = profile.calibration.target_ratio
    for metric in LATENCY_METRICS:
        data["slo"][metric] = round(measured[metric] / ratio, 4)
    data.setdefault("calibration", {})["baseline"] = Baseline(
        ttft_p95_s=round(measured["ttft_p95_s"], 4),
        tpot_p95_s=round(measured["tpot_p95_s"], 4),
        measured=(
            f"{dt.date.today().isoformat()} on {platform.node() or 'a machine'} "
            f"({os.cpu_count()} cores, {platform.machine()})"
        ),
        command=command,
    ).model_dump()
    text = path.read_text()
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    path.write_text(header + yaml.safe_dump(data, sort_keys=False, width=100))
    return Profile.load(path)


async def calibrate(target: Target, profile_path: Path, *, write: bool, command: str) -> int:
    """Measure the baseline; accept the profile's thresholds, or refuse them (exit 1). With
    ``write``: set each latency threshold to baseline / target ratio and record the baseline."""
    profile = target.profile
    measured, _ = await measure(target, profile)
    print(
        f"baseline at {profile.name}'s operating point ({measured['requests']} requests): "
        + ", ".join(f"{_LABELS[m]} {measured[m]:.4f}" for m in _LABELS if measured[m] is not None)
    )
    if any(measured[m] is None for m in LATENCY_METRICS) or measured["error_ratio"] > 0:
        print("CALIBRATION: REFUSED: the baseline run itself failed requests; fix that first")
        return 1
    if write:
        profile = write_thresholds(profile_path, profile, measured, command)
        ratio = profile.calibration.target_ratio
        print(f"wrote thresholds with the baseline at {ratio:.0%} of each to {profile_path}")
    problems = calibration_verdict(profile, measured)
    for problem in problems:
        print(f"  {problem}")
    rule = profile.calibration.min_baseline_ratio
    if problems:
        print(f"CALIBRATION: REFUSED (rule: baseline >= {rule:.0%} of each latency threshold)")
        return 1
    for metric in LATENCY_METRICS:
        threshold = getattr(profile.slo, metric)
        print(f"  {metric}: baseline {measured[metric] / threshold:.0%} of {threshold:.4f} s")
    print(f"CALIBRATION: ACCEPTED (rule: baseline >= {rule:.0%} of each latency threshold)")
    return 0
