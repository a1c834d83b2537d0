"""``python -m evals``: the deploy gate against a running Forge; ``python -m evals calibrate``.

    python -m evals --base-url http://127.0.0.1:8000 --key KEY [--admin-key KEY]
        [--flood-key KEY] [--quota-key KEY] [--redis-url URL] [--profile FILE] [--json FILE]
        [--only SUBSTRING ...] [--model M] [--pool P]
    python -m evals calibrate --base-url ... --key KEY [--profile FILE] [--write]
    python -m evals canary --model ENTRY --key KEY --admin-key KEY [--profile FILE]

Keys may come from the environment instead (FORGE_EVAL_KEY, FORGE_EVAL_ADMIN_KEY,
FORGE_EVAL_FLOOD_KEY, FORGE_EVAL_QUOTA_KEY, FORGE_EVAL_REDIS_URL), so they stay out of argv.
Exit code: 0 when the gate passes, 1 when it fails, 2 on bad usage; ``canary``: 0 promote,
1 abort, 3 hold (``evals/canary.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import sys
from pathlib import Path

from evals import canary, drills, gate, prompts, protocol, slo
from evals.profile import DEFAULT_PROFILE, Profile
from evals.target import Target


def all_checks() -> list[gate.Check]:
    """In order: cheap and read-only first, drills next, the SLO run last (on a quiet system)."""
    return protocol.checks() + prompts.checks() + drills.checks() + canary.checks() + slo.checks()


def _parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m evals", description=__doc__.split("\n")[0])
    p.add_argument(
        "command", nargs="?", choices=["gate", "calibrate", "canary", "list"], default="gate"
    )
    p.add_argument("--base-url", default=env("FORGE_BASE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--key", default=env("FORGE_EVAL_KEY"), help="the gate's tenant key")
    p.add_argument("--admin-key", default=env("FORGE_EVAL_ADMIN_KEY"))
    p.add_argument(
        "--admin-url",
        default=env("FORGE_ADMIN_URL"),
        help="the admin listener (/admin/*), where it is not the base URL",
    )
    p.add_argument("--flood-key", default=env("FORGE_EVAL_FLOOD_KEY"), help="a tenant to flood")
    p.add_argument(
        "--quota-key", default=env("FORGE_EVAL_QUOTA_KEY"), help="a tenant with a small budget"
    )
    p.add_argument("--redis-url", default=env("FORGE_EVAL_REDIS_URL"), help="the gateway's Redis")
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    p.add_argument("--model", default=None, help="default: the first model Forge lists")
    p.add_argument("--pool", default=None, help="default: the pool serving --model")
    p.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    p.add_argument("--only", nargs="*", default=None, help="checks whose name contains one")
    p.add_argument("--write", action="store_true", help="calibrate: write the thresholds")
    p.add_argument("--verbose", action="store_true", help="tracebacks of crashed checks")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    checks = all_checks()
    if args.only:
        checks = [c for c in checks if any(s in c.name for s in args.only)]
    if args.command == "list":
        for check in checks:
            print(check.name)
        print(f"{len(checks)} checks")
        return 0
    if not args.key:
        print("error: --key (or FORGE_EVAL_KEY) is required", file=sys.stderr)
        return 2
    target = Target(
        base_url=args.base_url,
        key=args.key,
        profile=Profile.load(args.profile),
        admin_key=args.admin_key,
        admin_url=args.admin_url,
        flood_key=args.flood_key,
        quota_key=args.quota_key,
        redis_url=args.redis_url,
        model=args.model,
        pool=args.pool,
        verbose=args.verbose,
    )
    if args.command == "calibrate":
        return asyncio.run(_calibrate(target, args.profile, args.write))
    if args.command == "canary":
        return asyncio.run(_canary(target, args.model))
    return asyncio.run(_gate(target, checks, args.json))


async def _calibrate(target: Target, profile: Path, write: bool) -> int:
    await target.discover()
    command = "python -m evals calibrate --profile " + shlex.quote(str(profile)) + " --write"
    return await slo.calibrate(target, profile, write=write, command=command)


async def _canary(target: Target, model: str | None) -> int:
    if not model:
        print("error: canary needs --model (a models: entry with an analysis)", file=sys.stderr)
        return 2
    try:
        decision, lines = await canary.analyse(target, model, target.profile)
    except (gate.Skipped, gate.Failed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return canary.EXIT[decision]


async def _gate(target: Target, checks: list[gate.Check], json_path: Path | None) -> int:
    try:
        await target.discover()
    except gate.Failed as exc:
        print(f"FAIL  cannot start: {exc}")
        print("DEPLOY GATE: FAIL")
        return 1
    serving = "primary" if target.primary_serving else "fallback (the primary is not serving)"
    print(
        f"Forge at {target.base_url}: model {target.model}, pool {target.pool}, "
        f"store {target.store_kind or 'unknown'}, fallback {target.fallback or 'none'}; "
        f"served now by {serving}; profile {target.profile.name}"
    )
    outcomes = await gate.run_checks(target, checks)
    print(gate.summary(outcomes))
    if json_path is not None:
        gate.write_json(json_path, target, outcomes)
    return 0 if gate.verdict(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
