"""What an idle Forge costs in memory, by role, and what of it is Ray's own (issue 36, item 5).

    python -m loadtest.memory [--idle-s 10] [--no-floor] [--check]
                              [--out loadtest/results/memory.json]

Starts ``serve run configs/local.yaml`` as a person would (its own session, so every process it
starts is counted: Ray's daemons, the dashboard and its helpers, HAProxy, one worker per
replica), waits until the primary serves, lets it idle, and reads each process's RSS, PSS and
USS from ``/proc/<pid>/smaps_rollup``. RSS counts a shared page once per process that maps it;
PSS splits it among them, so a sum of PSS is the graph's real footprint; USS is what would be
freed if that process alone went away. Then the same for the floor: the same Serve settings
(HAProxy, throughput mode, the same ``controller_options``) running one do-nothing deployment,
which is Ray's own cost plus the cheapest possible replica. Forge's share is the rest.

Prints a markdown table per graph and writes both to ``--out`` (JSON). ``--check`` fails (exit
1) when a pool application's do-nothing ingress runs a process: it is held at zero replicas
(``serve_app/app.py``), the cut this tool measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from loadtest import local_graph
from loadtest.processes import role_of

OUT = Path("loadtest/results/memory.json")
FLOOR_APP = "floor"
# Ray's and Serve's own processes: every graph has them, whatever it serves.
RAY_ROLES = frozenset(
    {
        "gcs",
        "raylet",
        "dashboard",
        "dashboard-modules",
        "dashboard-agent",
        "runtime-env-agent",
        "log-monitor",
        "autoscaler-monitor",
        "controller",
        "proxy",
        "haproxymanager",
        "haproxy",
        "idle-worker",
        "resource-tracker",
        "serve-run",
    }
)


class Floor:
    """The cheapest replica Serve can run: answers ``GET /`` and nothing else."""

    async def __call__(self, request) -> str:
        return "ok"


def floor(_args: dict) -> object:
    from ray import serve

    return serve.deployment(Floor).options(num_replicas=1, ray_actor_options={"num_cpus": 0}).bind()


def floor_config(local: Path) -> dict:
    """configs/local.yaml with its applications replaced by the floor: the same Serve settings
    and the same environment for the one replica."""
    config = yaml.safe_load(local.read_text())
    gateway = next(a for a in config["applications"] if a["name"] == "forge")
    env = {
        k: v for k, v in gateway["runtime_env"]["env_vars"].items() if k.startswith("RAY_SERVE_")
    }
    # The floor's deployment lives here, in loadtest/, which is not installed: the replica
    # finds it on PYTHONPATH, as the driver does from the repository root.
    env["PYTHONPATH"] = str(local_graph.REPO)
    config["applications"] = [
        {
            "name": FLOOR_APP,
            "route_prefix": "/",
            "import_path": "loadtest.memory:floor",
            "runtime_env": {"env_vars": env},
            "args": {},
        }
    ]
    return config


def smaps(pid: int) -> dict[str, int] | None:
    """KiB fields of ``/proc/<pid>/smaps_rollup``; None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = {}
    for line in text.splitlines()[1:]:
        name, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            fields[name] = int(rest.split()[0])
    return fields


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [word.decode(errors="replace") for word in raw.split(b"\0") if word]


def sample(session: int) -> dict[int, dict]:
    """Every process of the graph: its role and memory in MiB."""
    out = {}
    for pid in local_graph.session_pids(session):
        words = cmdline(pid)
        fields = smaps(pid)
        if not words or fields is None:  # gone, or a zombie
            continue
        role = "serve-run" if pid == session else role_of(words)
        out[pid] = {
            "role": role,
            "command": " ".join(words)[:120],
            "rss_mib": fields.get("Rss", 0) / 1024,
            "pss_mib": fields.get("Pss", 0) / 1024,
            "uss_mib": (fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)) / 1024,
        }
    return out


def by_role(samples: list[dict[int, dict]]) -> dict[str, dict]:
    """Per role: its processes and the median over the samples of their summed memory."""
    roles = sorted({p["role"] for s in samples for p in s.values()})
    table = {}
    for role in roles:
        rows = [[p for p in s.values() if p["role"] == role] for s in samples]
        table[role] = {
            "processes": max(len(r) for r in rows),
            **{
                k: round(statistics.median(sum(p[k] for p in r) for r in rows), 1)
                for k in ("rss_mib", "pss_mib", "uss_mib")
            },
        }
    return table


def measure(config: Path, ready, idle_s: float, log: Path, samples: int = 3) -> dict:
    """Start ``serve run config``, wait for ``ready(proc, log)``, idle, and read it."""
    proc = local_graph.start_graph(log, config)
    try:
        ready(proc, log)
        time.sleep(idle_s)
        taken = []
        for _ in range(samples):
            taken.append(sample(proc.pid))
            time.sleep(1)
    finally:
        local_graph.stop_graph(proc, drain=False)
    roles = by_role(taken)
    unknown = sorted({p["command"] for s in taken for p in s.values() if p["role"] == "other"})
    return {"roles": roles, "total": totals(roles.values()), "other_commands": unknown}


def totals(rows) -> dict:
    rows = list(rows)
    return {
        "processes": sum(r["processes"] for r in rows),
        **{k: round(sum(r[k] for r in rows), 1) for k in ("rss_mib", "pss_mib", "uss_mib")},
    }


def forge_ready(proc, log: Path) -> None:
    local_graph.wait_ready(local_graph.LOCAL_URL, proc, log, timeout_s=180)


def floor_ready(proc, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve run exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(local_graph.LOCAL_URL + "/", timeout=2, trust_env=False).text == "ok":
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("the floor graph did not answer GET /")


def split(forge: dict, floor: dict) -> dict:
    """Ray's own (its roles, as the floor runs them), Forge's replicas, and what they hold
    beyond as many do-nothing replicas. Beyond the floor is read in USS: a replica's PSS
    falls as more processes share its libraries, so the floor's (fewer sharers) reads higher."""
    replica_floor = floor["roles"][f"{FLOOR_APP}:Floor"]["uss_mib"]
    replicas = {role: r for role, r in forge["roles"].items() if ":" in role}
    return {
        "ray": totals(r for role, r in forge["roles"].items() if role in RAY_ROLES),
        "ray_floor": totals(r for role, r in floor["roles"].items() if role in RAY_ROLES),
        "replicas": totals(replicas.values()),
        "replica_floor_uss_mib": replica_floor,
        "replicas_beyond_floor_uss_mib": round(
            sum(r["uss_mib"] - r["processes"] * replica_floor for r in replicas.values()), 1
        ),
        "other": totals(
            r for role, r in forge["roles"].items() if role not in RAY_ROLES and ":" not in role
        ),
    }


def problems(forge: dict) -> list[str]:
    """What ``--check`` fails on."""
    return [
        f"{role} runs {row['processes']} process(es), {row['pss_mib']:.0f} MiB PSS: a pool "
        "application's ingress serves nothing and should run none"
        for role, row in forge["roles"].items()
        if role.startswith("forge-pool-") and role.endswith(":ingress") and row["processes"]
    ]


def table(name: str, graph: dict) -> str:
    lines = [
        f"{name}: {graph['total']['processes']} processes, "
        f"PSS {graph['total']['pss_mib']:.0f} MiB (RSS {graph['total']['rss_mib']:.0f})",
        "",
        "| role | processes | RSS MiB | PSS MiB | USS MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    rows = sorted(graph["roles"].items(), key=lambda kv: -kv[1]["pss_mib"])
    for role, r in [*rows, ("total", graph["total"])]:
        lines.append(
            f"| {role} | {r['processes']} | {r['rss_mib']:.0f} | {r['pss_mib']:.0f} "
            f"| {r['uss_mib']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle after ready, then read")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--config", type=Path, default=Path(local_graph.CONFIG))
    parser.add_argument("--no-floor", action="store_true", help="the graph only, no floor run")
    parser.add_argument("--check", action="store_true", help="fail on a running pool ingress")
    args = parser.parse_args(argv)
    if local_graph.port_answers(local_graph.LOCAL_URL):
        print(f"{local_graph.LOCAL_URL} already answers: stop it first", file=sys.stderr)
        return 2
    os.chdir(local_graph.REPO)
    floor_graph = parts = None
    with tempfile.TemporaryDirectory(prefix="forge-memory-") as work:
        work = Path(work)
        forge = measure(args.config, forge_ready, args.idle_s, work / "forge.log")
        print(table(str(args.config), forge), flush=True)
        if not args.no_floor:
            floor_yaml = work / "floor.yaml"
            floor_yaml.write_text(yaml.safe_dump(floor_config(args.config)))
            floor_graph = measure(floor_yaml, floor_ready, args.idle_s, work / "floor.log")
    if floor_graph is not None:
        print("\n" + table("the floor (one do-nothing deployment)", floor_graph))
        parts = split(forge, floor_graph)
        print("\n" + json.dumps(parts, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": "python -m loadtest.memory " + " ".join(argv or sys.argv[1:]),
                "idle_s": args.idle_s,
                "forge": forge,
                "floor": floor_graph,
                "split": parts,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")
    found = problems(forge)
    for problem in found:
        print(f"CHECK FAILED: {problem}", file=sys.stderr)
    return 1 if args.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
