"""The gate on the laptop graph, twice: ``python -m evals.local`` (what ``.ci/run`` runs).

Starts ``serve run configs/local.yaml``, runs the whole gate with its demo keys (alpha is the
gate's tenant, beta floods and has the small budget), then fails every replica of the primary
through ``POST /admin/faults`` and runs it again: with the primary gone the gate must still pass,
every answer the fallback's. Stops the graph, and exits 0 only if both runs passed. Writes each
run's outcomes to ``--json-dir`` (``loadtest/results/gate-primary-{up,down}.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx

from evals import cli, gate
from evals.profile import DEFAULT_PROFILE, Profile
from evals.target import Target
from loadtest.local_graph import (
    ADMIN_KEY,
    ALPHA_KEY,
    BETA_KEY,
    LOCAL_URL,
    POOL,
    REPO,
    port_answers,
    start_graph,
    stop_graph,
    wait_ready,
)


def target(profile: Path) -> Target:
    return Target(
        base_url=LOCAL_URL,
        key=ALPHA_KEY,
        profile=Profile.load(profile),
        admin_key=ADMIN_KEY,
        flood_key=BETA_KEY,
        quota_key=BETA_KEY,
    )


def fault(mode: str) -> None:
    response = httpx.post(
        f"{LOCAL_URL}/admin/faults",
        json={"pool": POOL, "fault": {"mode": mode}},
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    response.raise_for_status()


async def run(t: Target, json_path: Path, title: str, only: list[str] | None) -> bool:
    print(f"\n== {title} ==", flush=True)
    outcomes = await _gate(t, only)
    print(gate.summary(outcomes), flush=True)
    gate.write_json(json_path, t, outcomes)
    return gate.verdict(outcomes)


async def _gate(t: Target, only: list[str] | None) -> list[gate.Outcome]:
    try:
        await t.discover()
    except gate.Failed as exc:
        print(f"FAIL  cannot start: {exc}")
        return [gate.Outcome("discover", "gate", "FAIL", 0.0, "-", str(exc))]
    serving = "primary" if t.primary_serving else "fallback"
    print(f"model {t.model}, pool {t.pool}, store {t.store_kind}, served now by {serving}")
    checks = cli.all_checks()
    if only:
        checks = [c for c in checks if any(s in c.name for s in only)]
    return await gate.run_checks(t, checks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m evals.local", description=__doc__)
    parser.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    parser.add_argument("--json-dir", type=Path, default=REPO / "loadtest" / "results")
    parser.add_argument("--only", nargs="*", default=None, help="checks whose name contains one")
    parser.add_argument(
        "--log", type=Path, default=REPO / "loadtest" / "results" / "gate-serve.log"
    )
    args = parser.parse_args(argv)
    if port_answers(LOCAL_URL):
        parser.error(f"something already listens at {LOCAL_URL}; stop it first")
    started = time.monotonic()
    proc = start_graph(args.log)
    try:
        wait_ready(LOCAL_URL, proc, args.log, timeout_s=300)
        print(f"serve run configs/local.yaml ready in {time.monotonic() - started:.0f} s")
        up = asyncio.run(
            run(
                target(args.profile),
                args.json_dir / "gate-primary-up.json",
                "primary up",
                args.only,
            )
        )
        fault("error")
        try:
            down = asyncio.run(
                run(
                    target(args.profile),
                    args.json_dir / "gate-primary-down.json",
                    "primary failing every request (POST /admin/faults): fallback only",
                    args.only,
                )
            )
        finally:
            fault("none")
    finally:
        print("stopping serve run ...", flush=True)
        stop_graph(proc, drain=False)
    print(f"\nprimary up: {'PASS' if up else 'FAIL'}; primary down: {'PASS' if down else 'FAIL'}")
    return 0 if up and down else 1


if __name__ == "__main__":
    sys.exit(main())
