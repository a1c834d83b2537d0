"""Failover drill: the whole primary pool fails for 20 s under steady traffic.

    python -m loadtest.failover [--duration 60] [--down-at 20] [--up-at 40] [--check]

12 closed-loop streaming clients (~14 req/s) through Serve's proxy to two gateway replicas
(sharing the breaker board, and Redis for quotas). At ``--down-at`` every replica of the primary
pool starts failing every new request (fault injection: a 500 before the first frame, as from a
node that is gone; streams already running finish), at ``--up-at`` they recover. Required: no
client-visible error, the fallback serving during the outage, exactly one half-open probe per
half-open period (the one at recovery succeeds), and traffic back home after it; ``--check``
exits 1 unless all of that held. (The retry budget allows retries for 10 % of the requests of the
last 10 s, so an outage that starts in the first ~10 s finds too few requests behind it for the
12 clients' first failures: start it later.)

Writes ``loadtest/results/failover.json`` and ``docs/img/failover.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from loadtest import inprocess
from loadtest.http_load import _pct

KEY = "sk-drill-local-only"
APP = inprocess.APP
POOL = "primary"
CLIENTS = 12
# ~0.85 s a request with 12 clients in flight: ~14 req/s.
ENGINE = {
    "prefill_base_s": 0.02,
    "decode_base_s": 0.02,
    "max_num_seqs": 16,
    "output_tokens_min": 32,
    "output_tokens_max": 48,
}
BODY = {
    "model": "forge-sim",
    "messages": [{"role": "user", "content": "tell me about failover"}],
    "max_tokens": 40,
    "stream": True,
}


def forge_args(port: int, redis_url: str) -> dict:
    return {
        "gateway": {"deployment": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}}},
        "store": {"redis_url": redis_url, "key_prefix": "forge-drill:"},
        "tenants": [{"name": "drill", "key_hashes": [hashlib.sha256(KEY.encode()).hexdigest()]}],
        "resilience": {"breaker": {"cooldown_s": 5.0}},
        "pools": [
            {
                "name": POOL,
                "model": "forge-sim",
                "engine": ENGINE,
                "first_token_timeout_s": 5.0,
                "deployment": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0}},
            }
        ],
        "fallback": {
            "base_url": f"http://127.0.0.1:{port}/mock/v1",
            "model": "mock-gemini",
            "kinds": ["chat", "completion"],  # the mock serves both
        },
    }


@dataclass
class Outcome:
    start: float  # seconds since the drill began
    end: float
    status: int
    backend: str
    error_event: bool  # the stream ended with an SSE error event
    ttft: float | None


async def client(http: httpx.AsyncClient, began: float, until: float, out: list[Outcome]):
    headers = {"authorization": f"Bearer {KEY}"}
    while time.perf_counter() < until:
        start = time.perf_counter()
        ttft = None
        error_event = False
        status, backend = 0, "none"
        try:
            async with http.stream(
                "POST", "/v1/chat/completions", json=BODY, headers=headers
            ) as response:
                status, backend = response.status_code, response.headers.get("x-forge-backend")
                last = ""
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        if ttft is None:
                            ttft = time.perf_counter() - start
                        last = line
                error_event = status == 200 and '"error"' in last
        except httpx.HTTPError:
            status = 0
        end = time.perf_counter()
        served_by = backend or "none"
        out.append(Outcome(start - began, end - began, status, served_by, error_event, ttft))


async def watch(began: float, until: float, timeline: list[dict]) -> None:
    from serve_app.replica import admin as replica_admin

    while time.perf_counter() < until:
        boards = await asyncio.to_thread(replica_admin.describe_breakers, APP)
        pool = boards.get(POOL, {"state": "closed", "probes": 0, "transitions": 0})
        timeline.append({"t": time.perf_counter() - began, **pool})
        await asyncio.sleep(0.25)


async def drill(url: str, duration: float, down_at: float, up_at: float) -> dict:
    from serve_app.replica import admin as replica_admin

    outcomes: list[Outcome] = []
    timeline: list[dict] = []
    began = time.perf_counter()
    until = began + duration

    async def chaos() -> None:
        await asyncio.sleep(down_at)
        await asyncio.to_thread(replica_admin.set_fault_all, APP, f"pool-{POOL}", {"mode": "error"})
        await asyncio.sleep(up_at - down_at)
        await asyncio.to_thread(replica_admin.set_fault_all, APP, f"pool-{POOL}", None)

    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:
        await asyncio.gather(
            chaos(),
            watch(began, until, timeline),
            *(client(http, began, until, outcomes) for _ in range(CLIENTS)),
        )
    final = await asyncio.to_thread(replica_admin.describe_breakers, APP)
    return {"outcomes": [asdict(o) for o in outcomes], "timeline": timeline, "breakers": final}


def summarize(data: dict, down_at: float, up_at: float) -> dict:
    outcomes = [Outcome(**o) for o in data["outcomes"]]

    def phase(o: Outcome) -> str:
        return "before" if o.start < down_at else "outage" if o.start < up_at else "after"

    rows = {}
    for name in ("before", "outage", "after", "all"):
        chosen = [o for o in outcomes if name in ("all", phase(o))]
        totals = sorted(o.end - o.start for o in chosen if o.status == 200)
        rows[name] = {
            "requests": len(chosen),
            "served_by_fallback": sum(o.backend == "fallback" for o in chosen),
            "5xx": sum(o.status >= 500 for o in chosen),
            "client_visible_errors": sum(o.status != 200 or o.error_event for o in chosen),
            "total_p50_ms": round(_pct(totals, 50) * 1000),
            "total_p95_ms": round(_pct(totals, 95) * 1000),
        }
    after = [o for o in outcomes if o.start >= up_at]
    home = [o for o in after if o.backend == POOL]
    return {
        "phases": rows,
        "pool_breaker": data["breakers"].get(POOL, {}),
        "probes_granted_total": data["breakers"].get(POOL, {}).get("probes", 0),
        # The board's own count of the probes it granted in each half-open period.
        "probes_per_half_open_period": data["breakers"].get(POOL, {}).get("probes_per_half_open"),
        "first_home_after_recovery_s": round(min(o.start for o in home) - up_at, 2)
        if home
        else None,
        "served_home_in_last_10s": round(
            sum(o.backend == POOL for o in after if o.start > up_at + 10)
            / max(1, sum(1 for o in after if o.start > up_at + 10)),
            3,
        ),
    }


def plot(data: dict, down_at: float, up_at: float, path: Path) -> None:
    from loadtest.plots import save, subplots

    outcomes = [Outcome(**o) for o in data["outcomes"]]
    seconds = int(max(o.end for o in outcomes)) + 1
    primary = [0] * seconds
    fallback = [0] * seconds
    errors = [0] * seconds
    for o in outcomes:
        i = min(int(o.end), seconds - 1)
        if o.status != 200 or o.error_event:
            errors[i] += 1
        elif o.backend == "fallback":
            fallback[i] += 1
        else:
            primary[i] += 1
    fig, (ax1, ax2, ax3) = subplots(3, 1, figsize=(9, 7), sharex=True)
    xs = list(range(seconds))
    ax1.bar(xs, primary, width=1.0, label="primary pool", color="#2b7bba")
    ax1.bar(xs, fallback, width=1.0, bottom=primary, label="fallback", color="#f0a030")
    ax1.set_ylabel("served / s")
    ax1.legend(loc="upper right")
    level = {"closed": 0, "half_open": 1, "open": 2}
    ax2.step(
        [p["t"] for p in data["timeline"]],
        [level[p["state"]] for p in data["timeline"]],
        where="post",
        color="#c0392b",
    )
    ax2.set_yticks([0, 1, 2], ["closed", "half-open", "open"])
    # A half-open period lasts as long as its one probe (milliseconds against a dead pool), too
    # short to sample; the board counts the probes it granted in each.
    periods = data["breakers"].get(POOL, {}).get("probes_per_half_open") or []
    ax2.text(
        0.01,
        0.55,
        f"probes granted per half-open period: {periods}",
        transform=ax2.transAxes,
        fontsize=9,
    )
    ax2.set_ylabel("pool breaker")
    ax3.bar(xs, errors, width=1.0, color="#c0392b")
    ax3.set_ylabel("client errors / s")
    ax3.set_xlabel("seconds")
    ax3.set_ylim(0, max(1, max(errors)))
    for ax in (ax1, ax2, ax3):
        ax.axvspan(down_at, up_at, color="grey", alpha=0.15)
    ax1.set_title(f"Failover drill: primary pool down from {down_at:g}s to {up_at:g}s")
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60)
    parser.add_argument("--down-at", type=float, default=20)
    parser.add_argument("--up-at", type=float, default=40)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", default="loadtest/results/failover.json")
    parser.add_argument("--png", default="docs/img/failover.png")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the drill held")
    args = parser.parse_args()
    # The fallback answers at the primary's pace: a drill where failover looks faster than
    # home would flatter it.
    url = inprocess.start_forge_with_mock(lambda port: forge_args(port, args.redis_url), ENGINE)
    try:
        data = asyncio.run(drill(url, args.duration, args.down_at, args.up_at))
    finally:
        inprocess.stop_forge()
    summary = summarize(data, args.down_at, args.up_at)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, **data}, indent=1))
    plot(data, args.down_at, args.up_at, Path(args.png))
    print(json.dumps(summary, indent=1))
    failed = problems(summary)
    for problem in failed:
        print(f"FAILED {problem}", file=sys.stderr)
    if args.check and failed:
        sys.exit(1)


def problems(summary: dict) -> list[str]:
    """What the drill requires (the module's docstring) that this run broke."""
    out = []
    phases = summary["phases"]
    if phases["all"]["client_visible_errors"]:
        errors = {name: p["client_visible_errors"] for name, p in phases.items() if name != "all"}
        out.append(f"client-visible errors by phase: {errors}")
    if not phases["outage"]["served_by_fallback"]:
        out.append("the fallback served nothing during the outage")
    periods = summary["probes_per_half_open_period"] or []
    if not periods or any(n != 1 for n in periods):
        out.append(f"probes per half-open period {periods}, want one each")
    if summary["first_home_after_recovery_s"] is None:
        out.append("no request served by the primary after recovery")
    return out


if __name__ == "__main__":
    main()
