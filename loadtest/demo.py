"""The two-minute demo: real multi-tenant traffic, the primary pool fails and recovers.

    make demo        # = flock /tmp/forge-serve.lock .venv/bin/python -m loadtest.demo
    python -m loadtest.demo [--duration 120] [--fault-at 40] [--clear-at 80] [--profile steady]
        [--no-start --base-url http://127.0.0.1:8000]

Starts ``serve run configs/local.yaml`` from the repository root (its own process group and a
Ray of its own; log in ``loadtest/results/demo-serve.log``), waits for ``GET /v1/models`` and
for one chat served by the primary, then runs the ``steady`` profile open loop. At
``--fault-at`` every replica of the primary answers 500 (``POST /admin/faults``), at
``--clear-at`` it recovers; ``GET /admin/breakers`` is sampled once a second. Writes
``loadtest/results/demo.jsonl`` (one line per request), ``loadtest/results/demo.json`` (the
summary, per phase and per stream, and the breaker samples), ``docs/img/demo.png``, and prints a
Markdown table. Stops what it started and checks nothing of it is left.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

import httpx

from loadtest import profiles, timelapse, traffic
from loadtest.local_graph import (
    ADMIN_KEY,
    CONFIG,
    LOCAL_URL,
    POOL,
    REPO,
    port_answers,
    session_pids,
    start_graph,
    stop_graph,
    wait_ready,
)
from loadtest.traffic import Result, summarize

RESULTS = REPO / "loadtest" / "results"


async def drive(
    base_url: str,
    streams: list[traffic.Stream],
    duration: float,
    fault_at: float,
    clear_at: float,
    seed: int,
) -> tuple[list[Result], dict, dict]:
    """The load, the fault and its clearing, and the breaker samples, on one clock."""
    admin_headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    events: dict = {"faults": [], "breaker": [], "admin_errors": []}
    done = asyncio.Event()
    # run() starts its clock a few ms after it is called (it builds its client first). The
    # first result tells exactly when: it ended start + total after that clock began. From
    # then on the fault and the samples are on the results' own clock.
    clock = {"began": time.perf_counter(), "aligned": False}

    def align(r: Result) -> None:
        if not clock["aligned"]:
            clock["began"] = time.perf_counter() - (r.start + r.total)
            clock["aligned"] = True

    def now() -> float:
        return time.perf_counter() - clock["began"]

    async with httpx.AsyncClient(base_url=base_url, timeout=10, trust_env=False) as admin:

        async def set_fault(mode: str) -> None:
            body = {"pool": POOL, "fault": {"mode": mode}}
            try:
                response = await admin.post("/admin/faults", json=body, headers=admin_headers)
                ok = response.status_code == 200
                detail = response.text[:300]
            except httpx.HTTPError as exc:
                ok, detail = False, repr(exc)
            if not ok:
                events["admin_errors"].append({"t": now(), "fault": mode, "detail": detail})
                print(f"\nPOST /admin/faults {mode} failed: {detail}", file=sys.stderr)

        async def until(t: float) -> None:
            await asyncio.sleep(max(0.0, t - now() - 1.0))
            await asyncio.sleep(max(0.0, t - now()))  # re-read: the clock is aligned by now

        async def chaos() -> None:
            # Each time is taken when the admin call returned: every replica has the change.
            await until(fault_at)
            await set_fault("error")
            on = now()
            await until(clear_at)
            await set_fault("none")
            events["faults"].append([round(on, 3), round(now(), 3)])

        async def sample() -> None:
            tick = 0
            while not done.is_set():
                t = now()
                try:
                    response = await admin.get("/admin/breakers", headers=admin_headers)
                    pool = response.json().get(POOL, {}) if response.status_code == 200 else {}
                    state = pool.get("state", "closed")
                    events["breaker"].append(
                        {"t": round(t, 3), "state": state, "probes": pool.get("probes", 0)}
                    )
                except (httpx.HTTPError, ValueError) as exc:
                    events["admin_errors"].append({"t": t, "breakers": repr(exc)})
                tick += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), max(0.0, tick - now()))

        async def load() -> list[Result]:
            try:
                return await traffic.run(
                    base_url,
                    streams,
                    duration,
                    seed=seed,
                    progress=sys.stderr.isatty(),
                    on_result=align,
                )
            finally:
                done.set()

        results, _, _ = await asyncio.gather(load(), chaos(), sample())
        response = await admin.get("/admin/breakers", headers=admin_headers)
        breakers = response.json() if response.status_code == 200 else {}
    return results, events, breakers


def _row(results: list[Result]) -> dict:
    s = summarize(results)
    status = s["by_status"]

    def ms(v: float | None) -> int | None:
        return None if v is None else round(v * 1000)

    return {
        "requests": s["requests"],
        "by_backend": s["by_backend"],
        "by_status": {str(k): v for k, v in status.items()},
        "429": status.get(429, 0),
        "5xx": sum(n for code, n in status.items() if code >= 500),
        "transport_errors": status.get(0, 0),
        "truncated": s["truncated"],
        "client_visible_errors": s["failed"],
        "dropped": s["dropped"],
        "ttft_p50_ms": ms(s["ttft_p50_s"]),
        "ttft_p95_ms": ms(s["ttft_p95_s"]),
        "total_p50_ms": ms(s["total_p50_s"]),
        "total_p95_ms": ms(s["total_p95_s"]),
        "req_per_s": round(s["req_per_s"], 2),
    }


def summarize_demo(results: list[Result], breakers: dict, fault_at: float, clear_at: float) -> dict:
    phases = {
        "before": [r for r in results if r.start < fault_at],
        "fault": [r for r in results if fault_at <= r.start < clear_at],
        "after": [r for r in results if r.start >= clear_at],
        "all": results,
    }
    pool = breakers.get(POOL, {})
    home = [r.start for r in phases["after"] if r.backend == POOL]
    return {
        "phases": {name: _row(rs) for name, rs in phases.items()},
        "streams": {
            name: _row([r for r in results if r.stream == name])
            for name in dict.fromkeys(r.stream for r in results)
        },
        "probes": pool.get("probes", 0),
        "probes_per_half_open": pool.get("probes_per_half_open", []),
        "first_primary_after_clear_s": round(min(home) - clear_at, 2) if home else None,
    }


def _fmt(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def markdown(summary: dict, fault_at: float, clear_at: float) -> str:
    labels = {
        "before": f"before (0-{fault_at:g} s)",
        "fault": f"primary failing ({fault_at:g}-{clear_at:g} s)",
        "after": f"after ({clear_at:g} s-end)",
        "all": "all",
    }
    lines = [
        "| phase | requests | primary | fallback | cache | 429 | 5xx | client-visible errors "
        "| TTFT p50/p95 ms | total p50/p95 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in summary["phases"].items():
        b = row["by_backend"]
        lines.append(
            f"| {labels[name]} | {row['requests']:,} | {b.get(POOL, 0):,} | "
            f"{b.get('fallback', 0):,} | {b.get('cache', 0):,} | {row['429']:,} | "
            f"{row['5xx']:,} | {row['client_visible_errors']:,} | "
            f"{_fmt(row['ttft_p50_ms'])}/{_fmt(row['ttft_p95_ms'])} | "
            f"{_fmt(row['total_p50_ms'])}/{_fmt(row['total_p95_ms'])} |"
        )
    lines.append("")
    lines.append(
        f"Primary breaker: {summary['probes']} probe(s) granted; per half-open period "
        f"{summary['probes_per_half_open']}; first request served by the primary "
        f"{summary['first_primary_after_clear_s']} s after the fault cleared."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--fault-at", type=float, default=40.0)
    parser.add_argument("--clear-at", type=float, default=80.0)
    parser.add_argument("--profile", default="steady")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-start", action="store_true", help="use a gateway at --base-url")
    parser.add_argument("--base-url", default=LOCAL_URL)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "demo.jsonl")
    parser.add_argument("--summary", type=Path, default=RESULTS / "demo.json")
    parser.add_argument("--png", type=Path, default=REPO / "docs" / "img" / "demo.png")
    parser.add_argument("--log", type=Path, default=RESULTS / "demo-serve.log")
    args = parser.parse_args(argv)
    if not 0 <= args.fault_at <= args.clear_at <= args.duration:
        parser.error("need 0 <= --fault-at <= --clear-at <= --duration")
    if not args.no_start:
        if args.base_url.rstrip("/") != LOCAL_URL:
            parser.error(f"{CONFIG} listens at {LOCAL_URL}; use --no-start for another gateway")
        if port_answers(LOCAL_URL):
            print(
                f"Something already answers at {LOCAL_URL}: the demo starts its own graph there.\n"
                "Stop it first (serve shutdown -y, or end its `serve run`), or pass --no-start "
                "to drive the running gateway.",
                file=sys.stderr,
            )
            return 2
    streams = profiles.load_profile(args.profile).to_streams()

    # A SIGTERM (make killed, CI timeout) must still stop the graph: make it an exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    proc = None
    try:
        if not args.no_start:
            print(f"starting serve run {CONFIG} (log: {args.log})", flush=True)
            proc = start_graph(args.log)
        ready_began = time.monotonic()
        model = wait_ready(args.base_url, proc, args.log, args.ready_timeout)
        print(f"ready in {time.monotonic() - ready_began:.0f}s; {args.duration:g}s of load, "
              f"primary failing {args.fault_at:g}-{args.clear_at:g}s", flush=True)  # fmt: skip
        streams = [s if s.model else dataclasses.replace(s, model=model) for s in streams]
        results, events, breakers = asyncio.run(
            drive(args.base_url, streams, args.duration, args.fault_at, args.clear_at, args.seed)
        )
    finally:
        if proc is not None:
            print("stopping serve run ...", flush=True)
            killed = stop_graph(proc)
            left = session_pids(proc.pid)
            print(
                f"serve run exited ({proc.returncode}); "
                + (f"killed leftovers {killed}; " if killed else "")
                + ("nothing of it is left" if not left else f"STILL RUNNING: {left}"),
                flush=True,
            )

    summary = summarize_demo(results, breakers, args.fault_at, args.clear_at)
    traffic.write_jsonl(results, args.out)
    document = {
        "command": " ".join(["python -m loadtest.demo", *(argv or sys.argv[1:])]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {
            "duration_s": args.duration,
            "fault_at_s": args.fault_at,
            "clear_at_s": args.clear_at,
            "profile": args.profile,
            "seed": args.seed,
            "streams": [
                {k: v for k, v in dataclasses.asdict(s).items() if k != "key"} for s in streams
            ],
        },
        "summary": summary["phases"]["all"],
        **summary,
        "breakers": breakers,
        "events": events,
    }
    args.summary.parent.mkdir(parents=True, exist_ok=True)
    args.summary.write_text(json.dumps(document, indent=1) + "\n")
    all_ = summary["phases"]["all"]
    timelapse.render(
        results,
        args.png,
        title=f"Forge demo: {all_['requests']:,} requests, primary failing "
        f"{args.fault_at:g}-{args.clear_at:g} s",
        faults=[tuple(f) for f in events["faults"]],
        breaker=[(s["t"], s["state"]) for s in events["breaker"]],
        note=f"probes per half-open period: {summary['probes_per_half_open']}",
    )
    print()
    print(markdown(summary, args.fault_at, args.clear_at))
    print(f"\nwrote {args.out}, {args.summary}, {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
