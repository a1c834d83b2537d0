"""The canary analysis: a models: entry's canary against its stable variant, under the same
traffic, at the profile's operating point.

    python -m evals canary --model chat --key KEY --admin-key KEY [--profile FILE]

It sends the operating point's traffic to ``--model`` (each request its own prompt, so an entry
sticky per conversation or per request splits it as it splits everyone's), then reads the
gateway's own per-variant window (``GET /admin/status``: ``traffic``; ``serve_app/traffic/
watch.py``): requests, error ratio and p95 TTFT and TPOT of each variant, and the verdict of the
entry's ``analysis`` bounds. It prints the numbers and answers promote, hold or abort; a canary
the gateway already aborted (its weight set to 0) is an abort. Exit code: 0 promote, 1 abort,
3 hold (too few requests to tell: an entry sticky per tenant sends one tenant's traffic to one
variant, so the gate's own traffic cannot split it). With several gateway replicas, each judges
what it served: the one that answers the status call is read.
"""

from __future__ import annotations

from evals import slo
from evals.gate import Check, Failed, Served, Skipped
from evals.profile import Profile
from evals.target import Target
from loadtest import traffic

EXIT = {"promote": 0, "abort": 1, "hold": 3}


async def entry_status(target: Target, model: str) -> dict:
    status = (await target.admin("GET", "/admin/status")).json()
    entry = (status.get("traffic") or {}).get(model)
    if entry is None:
        raise Skipped(f"model {model!r} is not a models: entry of this gateway")
    if entry.get("analysis") is None:
        raise Skipped(f"model {model!r} has no analysis: bounds to judge its canary by")
    return entry


async def analyse(target: Target, model: str, profile: Profile) -> tuple[str, list[str]]:
    """Drive the operating point at ``model``, then read and judge; (decision, report lines)."""
    await entry_status(target, model)
    streams = slo.operating_streams(profile, target.key, model)
    duration_s = profile.operating_point.duration_s
    results = await traffic.run(target.base_url, streams, duration_s, seed=11)
    entry = await entry_status(target, model)
    return judged(entry, len(results))


def judged(entry: dict, sent: int) -> tuple[str, list[str]]:
    verdict = entry["verdict"] or {"decision": "hold", "reasons": ["no verdict"]}
    decision = "abort" if entry["aborted"] else verdict["decision"]
    analysis = entry["analysis"]
    lines = [f"sent {sent} requests; weights now {entry['weights']}"]
    for name, v in entry["variants"].items():
        lines.append(
            f"  {name:>10}: {v['requests']} requests, error ratio {v['error_ratio']:.3f}, "
            f"p95 TTFT {_ms(v['ttft_p95_s'])}, p95 TPOT {_ms(v['tpot_p95_s'])}"
        )
    lines.append(
        f"  bounds: canary {analysis['canary']!r} vs stable {analysis['stable']!r}: error ratio "
        f"+{analysis['max_error_ratio_increase']} at most, p95 TTFT {analysis['max_ttft_ratio']}x "
        f"at most, {analysis['min_requests']} requests each"
    )
    if entry["aborted"]:
        lines.append(f"  aborted by the gateway: {entry['aborted']} (weight 0)")
    lines += [f"  {reason}" for reason in verdict["reasons"]]
    lines.append(f"CANARY: {decision.upper()}")
    return decision, lines


async def canary_promotes(target: Target, served: Served) -> str:
    """The gate's check: fails on abort (and on hold: nothing shows the canary is good)."""
    if not target.model:
        raise Skipped("no model")
    decision, lines = await analyse(target, target.model, target.profile)
    if decision != "promote":
        raise Failed("; ".join(line.strip() for line in lines[1:]))
    return " ".join(line.strip() for line in lines[1:-1])


def checks() -> list[Check]:
    return [Check("canary:analysis-promotes", canary_promotes, "canary")]


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f} ms"
