"""Render a benchmark's JSON results as the Markdown table in docs/benchmarks.md.

python -m loadtest.report loadtest/results/overhead.json

Renders the overhead benchmark's results (``loadtest.overhead``: overhead, stages, side-by-side,
...) and the routing experiment's (``loadtest.routing``); any other file is refused by name
(exit 2), not a traceback. The other tools print their own tables.
"""

from __future__ import annotations

import json
import sys


def overhead_table(data: dict) -> str:
    rows = data["rows"]
    # Each round's rows over that round's direct baseline (``loadtest.overhead --rounds``).
    direct = {
        (r["engine"], r["concurrency"], r.get("round", 0)): r for r in rows if r["path"] == "direct"
    }
    rounds = len({r.get("round", 0) for r in rows}) > 1
    lines = [
        "| engine | path | c | req/s | TTFT p50 ms | added TTFT p50 ms | TTFT p95 ms | "
        "total p50 ms | server CPU ms/req | gateway-hop CPU ms/req | req/s per gateway core "
        "| errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = direct.get((r["engine"], r["concurrency"], r.get("round", 0)))
        added = r["ttft_p50_ms"] - base["ttft_p50_ms"] if base and r["path"] != "direct" else 0.0
        path = f"{r['path']} (round {r['round'] + 1})" if rounds else r["path"]
        lines.append(
            f"| {r['engine']} | {path} | {r['concurrency']} | {r['req_per_s']:.0f} | "
            f"{r['ttft_p50_ms']:.2f} | {added:.2f} | {r['ttft_p95_ms']:.2f} | "
            f"{r['total_p50_ms']:.1f} | {r['server_cpu_ms_per_req']:.2f} | "
            f"{r.get('gateway_cpu_ms_per_req', float('nan')):.2f} | "
            f"{r.get('req_per_gateway_core_s', float('nan')):.0f} | {r['errors']} |"
        )
    return "\n".join(lines)


def _kind(data: object) -> str | None:
    rows = data.get("rows") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not rows or not isinstance(rows[0], dict):
        return None
    if "meta" in data and {"path", "engine", "concurrency"} <= rows[0].keys():
        return "overhead"
    if {"workload", "policy", "oracle_hit_rate"} <= rows[0].keys():
        return "routing"
    return None


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m loadtest.report FILE")
    data = json.loads(open(sys.argv[1]).read())
    kind = _kind(data)
    if kind is None:
        print(
            f"loadtest.report: {sys.argv[1]} is neither loadtest.overhead's results nor "
            "loadtest.routing's, the two it renders (the other tools print their own tables)",
            file=sys.stderr,
        )
        sys.exit(2)
    if kind == "routing":
        print(routing_table(data))
        return
    print(
        f"Command: `{data['meta']['command']}`; machine: {data['meta']['machine']}, "
        f"Python {data['meta']['python']}.\n"
    )
    print(overhead_table(data))


def routing_table(data: dict) -> str:
    lines = [
        "| workload | policy | req/s | TTFT p50 ms | TTFT p95 ms | total p50 ms | total p95 ms "
        "| hit rate | oracle (same run) | % of oracle | max/mean load | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['workload']} | {r['policy']} | {r['req_per_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p95_ms']:.0f} | {r['total_p50_ms']:.0f} | {r['total_p95_ms']:.0f} | "
            f"{r['hit_rate']:.1%} | {r['oracle_hit_rate']:.1%} | "
            f"{r['hit_rate'] / r['oracle_hit_rate']:.0%} | "
            f"{r['max_over_mean_load']:.2f} | {r['errors']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
