"""A gate profile: the operating point the SLO is measured at, the thresholds, and the drills'
sizes, for one kind of deployment (``evals/profiles/local.yaml``, ``gke.yaml``).

The calibration rule: a latency threshold is accepted only if the baseline measured at the
operating point sits at >= ``calibration.min_baseline_ratio`` (40 %) of it. A gate whose baseline
is at 12 % of its threshold is green for the wrong reason: it cannot fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field

HERE = Path(__file__).parent
DEFAULT_PROFILE = HERE / "profiles" / "local.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoadStream(_Strict):
    name: str
    rate: Annotated[float, Field(gt=0)]  # requests/s, open loop
    prompt_tokens: Annotated[int, Field(ge=1)]
    max_tokens: Annotated[int, Field(ge=2)]  # two tokens at least: a time per output token


class OperatingPoint(_Strict):
    duration_s: Annotated[float, Field(gt=0)] = 30.0
    warmup_s: Annotated[float, Field(ge=0)] = 3.0  # results that start earlier are not judged
    streams: list[LoadStream]


class Slo(_Strict):
    ttft_p95_s: Annotated[float, Field(gt=0)]
    tpot_p95_s: Annotated[float, Field(gt=0)]
    error_ratio: Annotated[float, Field(ge=0, le=1)] = 0.01
    truncation_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0


LATENCY_METRICS = ("ttft_p95_s", "tpot_p95_s")


class Baseline(_Strict):
    ttft_p95_s: float
    tpot_p95_s: float
    measured: str  # when and where
    command: str


class Calibration(_Strict):
    min_baseline_ratio: Annotated[float, Field(gt=0, le=1)] = 0.4
    # What `evals calibrate --write` sets a threshold to: baseline / this ratio.
    target_ratio: Annotated[float, Field(gt=0, le=1)] = 0.5
    baseline: Baseline | None = None


class Isolation(_Strict):
    flood_rate: Annotated[float, Field(gt=0)] = 40.0  # the flooding tenant's requests/s
    flood_s: Annotated[float, Field(gt=0)] = 8.0
    victim_requests: Annotated[int, Field(ge=1)] = 5
    victim_total_s: Annotated[float, Field(gt=0)] = 5.0  # each victim request, end to end


class Failover(_Strict):
    rate: Annotated[float, Field(gt=0)] = 6.0  # requests/s while the drill runs
    fault_after_s: Annotated[float, Field(ge=0)] = 3.0
    fault_for_s: Annotated[float, Field(gt=0)] = 8.0
    home_within_s: Annotated[float, Field(gt=0)] = 30.0  # cool-down + one probe
    max_tokens: Annotated[int, Field(ge=1)] = 32


class Profile(_Strict):
    name: str
    description: str = ""
    operating_point: OperatingPoint
    slo: Slo
    calibration: Calibration = Calibration()
    isolation: Isolation = Isolation()
    failover: Failover = Failover()
    oversize_bytes: Annotated[int, Field(ge=1)] = 8 * 1024 * 1024  # above any body limit
    disconnect_streams: Annotated[int, Field(ge=1)] = 4

    @classmethod
    def load(cls, path: Path) -> Profile:
        return cls.model_validate(yaml.safe_load(path.read_text()))


def calibration_verdict(profile: Profile, baseline: dict[str, float]) -> list[str]:
    """Why these thresholds cannot be accepted at this baseline; empty when they can."""
    problems = []
    rule = profile.calibration.min_baseline_ratio
    for metric in LATENCY_METRICS:
        threshold, measured = getattr(profile.slo, metric), baseline[metric]
        ratio = measured / threshold
        if measured > threshold:
            problems.append(
                f"{metric}: the baseline {measured:.4f} s already breaks the threshold "
                f"{threshold:.4f} s: the gate would fail a healthy deployment"
            )
        elif ratio < rule - 1e-9:  # at the rule is accepted
            problems.append(
                f"{metric}: the baseline {measured:.4f} s is {ratio:.0%} of the threshold "
                f"{threshold:.4f} s, under the {rule:.0%} rule: the gate could not fail at this "
                f"operating point (set it <= {measured / rule:.4f} s, or raise the load)"
            )
    return problems
