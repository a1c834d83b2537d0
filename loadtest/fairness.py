"""Fair admission under a flood: a tenant with 40 workers against one with 2, on 8 slots.

    python -m loadtest.fairness [--duration 20] [--out loadtest/results/fairness.json]

Writes the per-tenant table (served, p50, p95, errors, beside the light tenant's solo baseline),
the CPU the gateway and the scheduler replicas spent per request during the flood (served and
refused: what shedding costs, read from each process's ``/proc/<pid>/stat``) as JSON, and a
PNG (``docs/img/fairness.png``) of queue depth and latency per tenant over time. The flood
backs off 0.5 s after a 429, as the OpenAI SDK does, and ignores Retry-After.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

from loadtest import plots
from loadtest.http_load import RunResult, closed_loop
from loadtest.inprocess import APP, start_forge, stop_forge

TENANTS = {"flood": 40, "light": 2}  # workers
ENGINE = {
    "prefill_base_s": 0.02,
    "prefill_per_token_s": 0.0001,
    "decode_base_s": 0.01,
    "decode_per_seq_s": 0.0001,
    "max_num_seqs": 8,
}
BODY = {
    "model": "forge-sim",
    "messages": [{"role": "user", "content": "a short answer please"}],
    "max_tokens": 16,
    "ignore_eos": True,
    "stream": True,
}


def key(tenant: str) -> str:
    return f"sk-fairness-{tenant}"


def forge_args(share: float) -> dict:
    return {
        "tenants": [
            {"name": t, "key_hashes": [hashlib.sha256(key(t).encode()).hexdigest()]}
            for t in TENANTS
        ],
        "pools": [
            {
                "name": "primary",
                "model": "forge-sim",
                "engine": ENGINE,
                "admission": {
                    "max_inflight": 8,
                    "queue_cap": 4,
                    "deadline_s": 5,
                    "max_tenant_share": share,
                },
                "deployment": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}},
            }
        ],
    }


async def sample_queues(stop: asyncio.Event, out: list[dict], started: float) -> None:
    import ray

    from serve_app.replica import admin as replica_admin

    rid = replica_admin.replica_ids(APP, "scheduler-primary")[0]
    while not stop.is_set():
        ref = replica_admin._call(APP, "scheduler-primary", rid, "snapshot")
        snap = await asyncio.to_thread(ray.get, ref)
        out.append({"t": time.perf_counter() - started, **snap})
        await asyncio.sleep(0.25)


def replica_pid(deployment: str) -> int:
    """The process of the one replica of ``deployment`` in the drill's application."""
    import ray

    from serve_app.replica import admin as replica_admin

    (rid,) = replica_admin.replica_ids(APP, deployment)
    actor = ray.get_actor(f"{replica_admin._PREFIX}{APP}#{deployment}#{rid}", namespace="serve")
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()))


def cpu_seconds(pid: int) -> float:
    """User and system CPU a process has spent (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(run: RunResult) -> dict:
    s = run.summary()
    return {
        "served": s["ok"],
        "refused_429": sum(1 for x in run.samples if x.status == 429),
        "errors": s["errors"] - sum(1 for x in run.samples if x.status == 429),
        "p50_ms": round(s["total_p50_ms"], 1),
        "p95_ms": round(s["total_p95_ms"], 1),
        "ttft_p50_ms": round(s["ttft_p50_ms"], 1),
    }


async def drill(url: str, duration: float) -> dict:
    endpoint = f"{url}/v1/chat/completions"
    solo = await closed_loop(
        endpoint,
        BODY,
        concurrency=TENANTS["light"],
        duration_s=duration / 2,
        api_key=key("light"),
    )
    pids = {
        role: replica_pid(f"{role}-primary" if role == "scheduler" else role)
        for role in ("gateway", "scheduler")
    }
    cpu0 = {role: cpu_seconds(pid) for role, pid in pids.items()}
    started = time.perf_counter()
    stop = asyncio.Event()
    queues: list[dict] = []
    sampler = asyncio.create_task(sample_queues(stop, queues, started))
    runs = await asyncio.gather(
        *(
            closed_loop(
                endpoint,
                BODY,
                concurrency=workers,
                duration_s=duration,
                api_key=key(tenant),
                pause_after_refusal_s=0.5,
            )
            for tenant, workers in TENANTS.items()
        )
    )
    stop.set()
    await sampler
    contended = dict(zip(TENANTS, runs, strict=True))
    requests = sum(len(r.samples) for r in runs)
    return {
        "cpu_ms_per_request": {
            role: round((cpu_seconds(pid) - cpu0[role]) * 1000 / max(1, requests), 2)
            for role, pid in pids.items()
        },
        "solo_light": summarize(solo),
        "tenants": {t: summarize(r) for t, r in contended.items()},
        "timeline": {
            "queues": [
                {"t": q["t"], **{t: q["queued"].get(t, 0) for t in TENANTS}} for q in queues
            ],
            "latency": {
                t: [(s.started - started, s.total) for s in r.samples if s.status == 200]
                for t, r in contended.items()
            },
        },
    }


def plot(result: dict, path: Path) -> None:
    fig, (top, bottom) = plots.subplots(2, 1, figsize=(9, 6), sharex=True)
    queues = result["timeline"]["queues"]
    for tenant in TENANTS:
        top.plot([q["t"] for q in queues], [q[tenant] for q in queues], label=tenant)
        points = result["timeline"]["latency"][tenant]
        bottom.scatter([p[0] for p in points], [p[1] * 1000 for p in points], s=6, label=tenant)
    baseline = result["solo_light"]["p50_ms"]
    bottom.axhline(baseline, color="grey", linestyle="--", label="light, solo p50")
    top.set_ylabel("queued requests")
    top.set_title("Fair admission: 40-worker flood vs 2-worker light tenant, 8 slots")
    bottom.set_ylabel("request latency (ms)")
    bottom.set_xlabel("seconds")
    top.legend()
    bottom.legend()
    plots.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=20)
    parser.add_argument("--out", default="loadtest/results/fairness.json")
    parser.add_argument("--plot", default="docs/img/fairness.png")
    parser.add_argument("--share", type=float, default=0.75, help="admission.max_tenant_share")
    args = parser.parse_args()
    url = start_forge(forge_args(args.share))
    try:
        result = asyncio.run(drill(url, args.duration))
    finally:
        stop_forge()
    plot(result, Path(args.plot))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    shown = ("solo_light", "tenants", "cpu_ms_per_request")
    print(json.dumps({k: result[k] for k in shown}, indent=1))


if __name__ == "__main__":
    main()
