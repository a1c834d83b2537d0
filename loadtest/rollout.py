"""Rollout drill: what each kind of configuration change costs the traffic under way.

As an operator does it on a laptop: ``serve run`` of a copy of configs/local.yaml, streaming
clients through :8000, then ``serve deploy`` of changed copies, one per phase, with Ray's token
(``RAY_AUTH_MODE=token``, the token ``serve run`` made):

- **tenant**: the gateway's ``user_config`` raises beta's rpm and adds a tenant (live);
- **refused**: a ``user_config`` with a bad field (refused; the running configuration stays);
- **pool-options**: the primary pool's Ray actor options, in its ``deployments`` entry of its
  application (a deployment option: Serve rolls that deployment alone);
- **pool**: one engine setting of the primary pool (its own application's ``args``);
- **gateway**: one gateway setting (the gateway application's ``args``). The schedulers and
  the breaker board run in the control application (``forge-control``): the phase opens the
  embedding pool's breaker first (its replica answering 500, then healed), samples the primary
  pool's slots while the gateways roll, and checks that the scheduler and the board were kept,
  the slots never went past the budget, and the breaker is still open afterwards.

Per phase: the requests started in it, completed, truncated (200 then no end), errors, served
by the fallback; how long the rollout took (``serve deploy`` until no replica is starting or
stopping, and the change is served); and which replicas were replaced (ids and PIDs from the
dashboard's Serve API).

    python -m loadtest.rollout                  # docs/benchmarks.md's table, ~4 minutes
    python -m loadtest.rollout --phases tenant refused pool-options pool --check   # CI

``--check`` exits 1 unless: a live change replaced no replica, lost no request and served its
new tenant; a refused change kept the running configuration and named the bad field; a pool's
deployment options replaced that pool's replicas and nothing else; a pool's engine setting
replaced that pool's application and nothing else; a gateway change replaced the gateway and
neither the scheduler nor the board, kept the pool within its slots and an open breaker open;
and no phase truncated a stream or answered with an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from loadtest import traffic
from loadtest.local_graph import (
    ADMIN_KEY,
    ALPHA_KEY,
    CONFIG,
    LOCAL_URL,
    REPO,
    port_answers,
    start_graph,
    stop_graph,
    wait_ready,
)
from serve_app.auth.keys import hash_key
from serve_app.config.live import gateway_user_config

DASHBOARD = "http://127.0.0.1:8265"
GAMMA_KEY = "sk-drill-gamma-local-only"  # the tenant the tenant phase adds
PHASES = ("tenant", "refused", "pool-options", "pool", "gateway")
POOL = "pool-primary"  # the deployment the pool phases change
POOL_APP = "forge-pool-primary"  # the application it runs in (configs/local.yaml)
CONTROL_APP = "forge-control"  # the schedulers' and the board's (configs/local.yaml)
KEPT_BY_GATEWAY = (f"{CONTROL_APP}/scheduler-primary", f"{CONTROL_APP}/breaker-board")
SETTLE_S = 5.0  # traffic after a rollout, still counted in its phase
REQUEST_TIMEOUT_S = 120.0


@dataclass
class Phase:
    name: str
    start: float  # seconds since the drill's traffic began
    deploy_s: float = 0.0  # `serve deploy` itself
    rollout_s: float = 0.0  # from `serve deploy` to the change served and nothing in flux
    end: float = 0.0
    replaced: dict[str, int] = field(default_factory=dict)  # deployment → replicas replaced
    kept: dict[str, int] = field(default_factory=dict)  # deployment → same id and PID
    note: str = ""
    breaker_before: str = ""  # gateway: the opened breaker's state before the roll
    slots: dict[str, int] = field(default_factory=dict)  # gateway: slots sampled while it rolls


def _tenants(app: dict) -> list[dict]:
    return gateway_user_config(app)["tenants"]


def variant(base: dict, phase: str) -> dict:
    """The serve config of a phase: the previous one with its change."""
    config = copy.deepcopy(base)
    (app,) = [a for a in config["applications"] if a["name"] == "forge"]
    (pool_app,) = [a for a in config["applications"] if a["name"] == POOL_APP]
    if phase == "tenant":
        beta = next(t for t in _tenants(app) if t["name"] == "beta")
        beta["limits"]["rpm"] = 600
        _tenants(app).append({"name": "gamma", "key_hashes": [hash_key(GAMMA_KEY)]})
    elif phase == "refused":
        _tenants(app)[0]["limits"]["rpm"] = -1
    elif phase == "pool-options":
        deployments = pool_app.setdefault("deployments", [])
        entry = next((d for d in deployments if d["name"] == POOL), None)
        if entry is None:
            entry = {"name": POOL}
            deployments.append(entry)
        entry["ray_actor_options"] = {"num_cpus": 0.01}
    elif phase == "pool":
        engine = pool_app["args"]["pool"]["engine"]
        engine["decode_base_s"] = round(engine["decode_base_s"] + 0.001, 4)
    elif phase == "gateway":
        app["args"]["gateway"]["max_body_bytes"] += 1024
    return config


class Cluster:
    """The Serve API behind the dashboard, with Ray's token."""

    def __init__(self) -> None:
        serve = Path(sys.executable).parent
        token = subprocess.run(
            [str(serve / "ray"), "get-auth-token"], capture_output=True, text=True, check=True
        ).stdout.strip()
        self.bin = serve
        self.headers = {"authorization": f"Bearer {token}"}
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }

    def deploy(self, path: Path) -> float:
        started = time.perf_counter()
        subprocess.run(
            [str(self.bin / "serve"), "deploy", str(path), "--address", DASHBOARD],
            cwd=REPO,
            env=self.env,
            check=True,
            capture_output=True,
        )
        return time.perf_counter() - started

    def replicas(self) -> dict[str, dict[str, tuple[int, str]]]:
        """Deployment → replica id → (PID, state), for Forge's applications (the gateway's and
        each pool's); a pool application's ingress is ``<app>/ingress``."""
        details = httpx.get(
            f"{DASHBOARD}/api/serve/applications/", headers=self.headers, timeout=10
        ).json()
        found: dict[str, dict[str, tuple[int, str]]] = {"_status": {}}
        for app_name, app in details["applications"].items():
            if app_name not in ("forge", CONTROL_APP) and not app_name.startswith("forge-pool-"):
                continue
            found["_status"][app_name] = (0, app["status"])
            for name, d in app["deployments"].items():
                key = (
                    name
                    if app_name == "forge" or name.startswith("pool-")
                    else f"{app_name}/{name}"
                )
                found[key] = {r["replica_id"]: (r.get("pid"), r["state"]) for r in d["replicas"]}
        return found


def settled(replicas: dict) -> bool:
    """The apps are running and no replica is starting or stopping (a stopping gateway replica is
    held 5 s: configs/local.yaml)."""
    if not replicas["_status"] or any(s != "RUNNING" for _, s in replicas["_status"].values()):
        return False
    return all(
        state == "RUNNING"
        for name, rs in replicas.items()
        if name != "_status"
        for _, state in rs.values()
    )


def compare(before: dict, after: dict) -> tuple[dict[str, int], dict[str, int]]:
    replaced, kept = {}, {}
    for name, old in before.items():
        if name == "_status":
            continue
        new = after.get(name, {})
        same = sum(1 for rid, (pid, _) in old.items() if rid in new and new[rid][0] == pid)
        kept[name], replaced[name] = same, len(old) - same
    return replaced, kept


def _admin(method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.request(method, f"{LOCAL_URL}{path}", headers=headers, timeout=30, **kwargs)


def admin_status() -> dict:
    return _admin("GET", "/admin/status").json()


def key_works(key: str) -> bool:
    body = {
        "model": "forge-sim-1b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
    }
    try:
        response = httpx.post(
            f"{LOCAL_URL}/v1/chat/completions",
            json=body,
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        )
    except httpx.HTTPError:
        return False
    return response.status_code == 200


OPENED = "embed"  # the pool whose breaker the gateway phase opens (no drill traffic uses it)


def breaker_state(backend: str) -> str:
    return _admin("GET", "/admin/breakers").json().get(backend, {}).get("state", "closed")


def open_a_breaker(pool: str) -> str:
    """Make ``pool``'s replicas answer 500 until its breaker opens, then heal them: the breaker
    stays open (no request probes it); what it is before the gateway rolls."""
    fault = {"pool": pool, "fault": {"mode": "error"}}
    _admin("POST", "/admin/faults", json=fault).raise_for_status()
    body = {"model": "forge-embed", "input": "x"}
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    try:
        for _ in range(20):
            httpx.post(f"{LOCAL_URL}/v1/embeddings", json=body, headers=headers, timeout=30)
            if breaker_state(pool) == "open":
                break
    finally:
        _admin("POST", "/admin/faults", json={"pool": pool, "fault": {"mode": "none"}})
    return breaker_state(pool)


class SlotWatch:
    """The primary pool's admission slots, sampled from ``/admin/status`` while the gateways
    roll (whichever gateway answers: they share the scheduler)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        self.max_used = self.total = self.n = 0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> SlotWatch:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                (pool,) = [p for p in admin_status()["pools"] if p["name"] == "primary"]
            except (httpx.HTTPError, ValueError, KeyError):
                continue  # a gateway going away: the next sample
            admission = pool["admission"] or {}
            self.max_used = max(self.max_used, admission.get("slots_used", 0))
            self.total = admission.get("slots_total", self.total)
            self.n += 1


def wait_for(condition, timeout_s: float, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return True
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(interval_s)
    return False


def run_phase(cluster: Cluster, config: dict, phase: Phase, workdir: Path, began: float) -> dict:
    """Deploy the phase's config and wait until its change is served and nothing is in flux."""
    changed = variant(config, phase.name)
    if phase.name == "gateway":
        phase.breaker_before = open_a_breaker(OPENED)
    path = workdir / f"{phase.name}.yaml"
    path.write_text(yaml.safe_dump(changed, sort_keys=False))
    before = cluster.replicas()
    digest_before = admin_status()["config"]["digest"]
    t0 = time.perf_counter()
    phase.deploy_s = cluster.deploy(path)
    if phase.name == "tenant":
        served = wait_for(lambda: key_works(GAMMA_KEY), 60)
        phase.note = "new tenant's key served" if served else "new tenant's key NOT served"
    elif phase.name == "refused":
        refused = wait_for(lambda: admin_status()["config"]["refused"] is not None, 60)
        status = admin_status()["config"]
        kept = status["digest"] == digest_before
        error = (status["refused"] or {}).get("error", "")
        phase.note = (
            f"refused: {refused}; configuration kept: {kept}; "
            f"error names tenants.0.limits.rpm: {'tenants.0.limits.rpm' in error}"
        )
        changed = config  # what runs is still the previous configuration
    with SlotWatch() if phase.name == "gateway" else contextlib.nullcontext() as slots:
        time.sleep(2)  # Serve notices the new target
        wait_for(lambda: settled(cluster.replicas()), 300, 1.0)
    phase.rollout_s = time.perf_counter() - t0
    phase.replaced, phase.kept = compare(before, cluster.replicas())
    if slots is not None:
        breaker = breaker_state(OPENED)
        phase.slots = {"max_used": slots.max_used, "total": slots.total, "samples": slots.n}
        phase.note = (
            f"slots used at most {slots.max_used} of {slots.total} ({slots.n} samples); "
            f"{OPENED}'s breaker {breaker} after the roll"
        )
    time.sleep(SETTLE_S)
    phase.end = time.perf_counter() - began
    return changed


async def drive(stop: asyncio.Event, began: float, clients: int, results: list) -> None:
    """``clients`` closed-loop streaming clients (alpha's key) until ``stop``; each finishes
    the request it has under way."""
    stream = traffic.Stream("alpha", ALPHA_KEY, rate=1, prompt_tokens=64, max_tokens=48)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    # A patient client, as the OpenAI SDK is (600 s): httpx's default of 5 s would count a
    # request that waits out a rollout as an error and hide how long it waited.
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    async with httpx.AsyncClient(
        base_url=LOCAL_URL, limits=limits, timeout=timeout, trust_env=False
    ) as http:

        async def client(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                prompt = traffic.prompt_of(64, f"rollout:{i}:{n}:{time.time()}")
                results.append(
                    await traffic._send(
                        http, stream, "forge-sim-1b", prompt, began, REQUEST_TIMEOUT_S
                    )
                )

        await asyncio.gather(*(client(i) for i in range(clients)))


def summarize(phases: list[Phase], results: list[traffic.Result], warmup_end: float) -> list[dict]:
    rows = []
    windows = [("steady", 0.0, warmup_end, None)] + [(p.name, p.start, p.end, p) for p in phases]
    for name, start, end, phase in windows:
        inside = [r for r in results if start <= r.start < end]
        row = {
            "phase": name,
            "requests": len(inside),
            "completed": sum(1 for r in inside if r.status == 200 and not r.truncated),
            "truncated": sum(1 for r in inside if r.truncated),
            "errors": sum(1 for r in inside if r.status != 200),
            "fallback": sum(1 for r in inside if r.backend == "fallback"),
            "error_kinds": dict(Counter(r.error for r in inside if r.error)),
            "ttft_p50_s": _quantile([r.ttft for r in inside if r.ttft is not None], 0.5),
            "ttft_max_s": _quantile([r.ttft for r in inside if r.ttft is not None], 1.0),
        }
        if phase is not None:
            row |= {
                "deploy_s": round(phase.deploy_s, 1),
                "rollout_s": round(phase.rollout_s, 1),
                "replaced": {k: v for k, v in phase.replaced.items() if v},
                "kept": {k: v for k, v in phase.kept.items() if v},
                "note": phase.note,
                "breaker_before": phase.breaker_before,
                "slots": phase.slots,
            }
        rows.append(row)
    return rows


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)


def problems(rows: list[dict]) -> list[str]:
    """What ``--check`` fails on (see the module docstring)."""
    found = []
    for row in rows:
        name = row["phase"]
        if row["truncated"] or row["errors"]:
            found.append(f"{name}: {row['truncated']} truncated, {row['errors']} errors")
        if name in ("tenant", "refused") and row.get("replaced"):
            found.append(f"{name}: replicas replaced {row['replaced']} by a live change")
        if name == "pool-options" and set(row.get("replaced", {})) != {POOL}:
            found.append(f"pool-options: replaced {row.get('replaced')}, not {POOL} alone")
        # The pool's application is its replicas and its ingress, which runs at zero replicas
        # (serve_app/app.py) unless something called it.
        if name == "pool" and set(row.get("replaced", {})) - {f"{POOL_APP}/ingress"} != {POOL}:
            found.append(f"pool: replaced {row.get('replaced')}, not {POOL_APP}'s alone")
        if name == "tenant" and "NOT" in row.get("note", ""):
            found.append(f"tenant: {row['note']}")
        if name == "refused" and "False" in row.get("note", ""):
            found.append(f"refused: {row['note']}")
        if name == "gateway":
            found += _gateway_problems(row)
    return found


def _gateway_problems(row: dict) -> list[str]:
    found = []
    replaced = row.get("replaced", {})
    if "gateway" not in replaced or any(replaced.get(d) for d in KEPT_BY_GATEWAY):
        found.append(f"gateway: replaced {replaced}, not the gateway alone")
    slots = row.get("slots") or {}
    if not slots.get("samples") or slots["max_used"] > slots["total"]:
        found.append(f"gateway: slots {slots}: past the budget, or never sampled")
    if row.get("breaker_before") != "open" or f"{OPENED}'s breaker open" not in row["note"]:
        found.append(
            f"gateway: {OPENED}'s breaker {row.get('breaker_before')} before; {row['note']}"
        )
    return found


def markdown(rows: list[dict]) -> str:
    lines = [
        "| phase | requests | completed | truncated | errors | fallback | TTFT p50 s "
        "| TTFT max s | rollout s | replicas replaced | replicas kept (same id and PID) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        replaced = ", ".join(f"{k} {v}" for k, v in r.get("replaced", {}).items()) or "none"
        kept = ", ".join(f"{k} {v}" for k, v in r.get("kept", {}).items()) or "none"
        rollout = r.get("rollout_s", "")
        if "rollout_s" not in r:
            replaced = kept = ""
        lines.append(
            f"| {r['phase']} | {r['requests']} | {r['completed']} | {r['truncated']} | "
            f"{r['errors']} | {r['fallback']} | {r.get('ttft_p50_s')} | {r.get('ttft_max_s')} | "
            f"{rollout} | {replaced} | {kept} |"
        )
    return "\n".join(lines)


async def drill(phases: list[str], clients: int, warmup_s: float, workdir: Path) -> list[dict]:
    config = yaml.safe_load((REPO / CONFIG).read_text())
    (app,) = [a for a in config["applications"] if a["name"] == "forge"]
    for tenant in _tenants(app):  # the drill's own traffic must not meet alpha's rpm
        tenant["limits"]["rpm"] = max(tenant["limits"].get("rpm", 0), 100_000)
    cluster = Cluster()
    cluster.deploy(_write(workdir / "base.yaml", config))
    wait_for(lambda: settled(cluster.replicas()) and key_works(ALPHA_KEY), 300, 1.0)
    results: list[traffic.Result] = []
    stop = asyncio.Event()
    began = time.perf_counter()
    load = asyncio.create_task(drive(stop, began, clients, results))
    await asyncio.sleep(warmup_s)
    done: list[Phase] = []
    for name in phases:
        phase = Phase(name, start=time.perf_counter() - began)
        print(f"phase {name} ...", flush=True)
        config = await asyncio.to_thread(run_phase, cluster, config, phase, workdir, began)
        print(f"  {asdict(phase)}", flush=True)
        done.append(phase)
    stop.set()
    await load
    return summarize(done, results, warmup_s)


def _write(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--out", default="loadtest/results/rollout.json")
    parser.add_argument("--check", action="store_true", help="exit 1 on a broken expectation")
    args = parser.parse_args(argv)
    if port_answers(LOCAL_URL):
        print(f"{LOCAL_URL} already answers: stop that gateway first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="forge-rollout-") as tmp:
        workdir = Path(tmp)
        log = workdir / "serve-run.log"
        proc = start_graph(log)
        try:
            wait_ready(LOCAL_URL, proc, log, 300)
            rows = asyncio.run(drill(args.phases, args.clients, args.warmup, workdir))
        finally:
            stop_graph(proc, drain=False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"clients": args.clients, "rows": rows}, indent=1))
    print(markdown(rows))
    for row in rows:
        if row.get("note"):
            print(f"{row['phase']}: {row['note']}")
    failed = problems(rows)
    for problem in failed:
        print(f"FAILED {problem}", file=sys.stderr)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
