"""The gate's runner: checks in order, one line each, and a verdict with its exit code.

A check is an async function of the ``Target``; it raises ``Failed`` (or any exception) to fail,
``Skipped`` to skip with a reason, and records who served its requests through ``Served``. A
skip never fails the gate, so every skip says why in the output.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from evals.target import Target


class Failed(Exception):
    """The check's assertion did not hold; the message says what was seen."""


class Skipped(Exception):
    """The check cannot run against this target; the message says why."""


def expect(condition: object, message: str) -> None:
    if not condition:
        raise Failed(message)


class Served(Counter):
    """Who answered a check's requests: primary pool names, "fallback", "cache"."""

    def saw(self, backend: str | None, cache: str | None = None) -> None:
        self["cache" if cache == "hit" else (backend or "unknown")] += 1

    def describe(self, pools: Iterable[str]) -> str:
        if not self:
            return "-"
        pools = set(pools)
        kinds = Counter()
        for name, n in self.items():
            kinds["primary" if name in pools else name] += n
        return "+".join(f"{k}" if len(kinds) == 1 else f"{k}:{n}" for k, n in kinds.most_common())


CheckFn = Callable[["Target", Served], Awaitable[str | None]]


@dataclass(frozen=True)
class Check:
    name: str
    run: CheckFn
    group: str


@dataclass
class Outcome:
    name: str
    group: str
    status: str  # PASS, FAIL, SKIP
    seconds: float
    served: str
    detail: str = ""
    served_counts: dict[str, int] = field(default_factory=dict)


async def run_checks(
    target: Target, checks: Sequence[Check], out: TextIO = sys.stdout
) -> list[Outcome]:
    outcomes = []
    for check in checks:
        served = Served()
        started = time.perf_counter()
        try:
            detail = await check.run(target, served) or ""
            status = "PASS"
        except Skipped as exc:
            status, detail = "SKIP", str(exc)
        except Failed as exc:
            status, detail = "FAIL", str(exc)
        except TimeoutError:
            status, detail = "FAIL", "timed out"
        except Exception as exc:  # a crash in a check is a failed check, with its cause
            status = "FAIL"
            detail = f"{type(exc).__name__}: {exc}"
            if target.verbose:
                traceback.print_exc()
        outcome = Outcome(
            check.name,
            check.group,
            status,
            time.perf_counter() - started,
            served.describe(target.pool_names),
            detail,
            dict(served),
        )
        outcomes.append(outcome)
        print(line(outcome), file=out, flush=True)
    return outcomes


def line(o: Outcome) -> str:
    detail = f"  {o.detail}" if o.detail else ""
    return f"{o.status:4}  {o.seconds:6.2f}s  {o.served:<22}  {o.name}{detail}"


def verdict(outcomes: Sequence[Outcome]) -> bool:
    return bool(outcomes) and all(o.status != "FAIL" for o in outcomes)


def summary(outcomes: Sequence[Outcome]) -> str:
    counts = Counter(o.status for o in outcomes)
    word = "PASS" if verdict(outcomes) else "FAIL"
    return (
        f"DEPLOY GATE: {word}  ({counts['PASS']} passed, {counts['FAIL']} failed, "
        f"{counts['SKIP']} skipped of {len(outcomes)} checks)"
    )


def write_json(path: Path, target: Target, outcomes: Sequence[Outcome]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "base_url": target.base_url,
        "model": target.model,
        "pool": target.pool,
        "passed": verdict(outcomes),
        "checks": [asdict(o) for o in outcomes],
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
