"""The memory reading of ``python -m loadtest.memory``: what it counts and how it splits it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from loadtest import local_graph, memory, processes

LOCAL = local_graph.REPO / local_graph.CONFIG


def test_the_floor_runs_under_the_laptop_graphs_serve_settings():
    local = yaml.safe_load(LOCAL.read_text())
    floor = memory.floor_config(LOCAL)
    for key in ("proxy_location", "http_options", "controller_options"):
        assert floor[key] == local[key]
    [app] = floor["applications"]
    gateway_env = next(a for a in local["applications"] if a["name"] == "forge")["runtime_env"]
    serve_env = {k: v for k, v in gateway_env["env_vars"].items() if k.startswith("RAY_SERVE_")}
    assert serve_env and serve_env.items() <= app["runtime_env"]["env_vars"].items()
    assert "FORGE_FALLBACK_API_KEY" not in app["runtime_env"]["env_vars"]
    assert app["runtime_env"]["env_vars"]["PYTHONPATH"] == str(local_graph.REPO)
    module, _, builder = app["import_path"].partition(":")
    assert module == "loadtest.memory" and callable(getattr(memory, builder))


def test_a_session_is_read_from_proc_by_process():
    child = subprocess.Popen(
        [sys.executable, "-c", 'import time; b = b"x" * (48 << 20); time.sleep(60)'],
        start_new_session=True,
        stdout=subprocess.PIPE,
    )
    try:
        for _ in range(100):  # until the 48 MiB are touched
            seen = memory.sample(child.pid)
            if seen and seen[child.pid]["uss_mib"] > 48:
                break
            subprocess.run(["sleep", "0.05"])
        row = seen[child.pid]
        assert row["role"] == "serve-run"  # the session's leader is what `serve run` would be
        assert row["rss_mib"] >= row["pss_mib"] >= row["uss_mib"] > 48
    finally:
        child.kill()
        child.wait()
    assert memory.sample(child.pid) == {}


def _proc(role: str, pss: float) -> dict:
    return {"role": role, "rss_mib": pss * 2, "pss_mib": pss, "uss_mib": pss / 2}


def test_each_role_is_the_median_of_its_summed_samples():
    samples = [
        {1: _proc("gcs", 10), 2: _proc("forge:gateway", 100)},
        {1: _proc("gcs", 30), 2: _proc("forge:gateway", 90), 3: _proc("forge:gateway", 20)},
        {1: _proc("gcs", 20), 2: _proc("forge:gateway", 95)},
    ]
    roles = memory.by_role(samples)
    assert roles["gcs"] == {"processes": 1, "rss_mib": 40.0, "pss_mib": 20.0, "uss_mib": 10.0}
    assert roles["forge:gateway"]["processes"] == 2
    assert roles["forge:gateway"]["pss_mib"] == 100.0  # of 100, 110 and 95


def test_forges_share_is_what_ray_and_the_do_nothing_replica_do_not_explain():
    def graph(rows: dict[str, tuple[int, float]]) -> dict:
        roles = {
            role: {"processes": n, "rss_mib": p, "pss_mib": p, "uss_mib": p}
            for role, (n, p) in rows.items()
        }
        return {"roles": roles, "total": memory.totals(roles.values())}

    forge = graph(
        {
            "gcs": (1, 50),
            "haproxy": (1, 10),
            "forge:gateway": (1, 160),
            "forge-pool-primary:pool-primary": (2, 240),
            "loadgen": (1, 5),
        }
    )
    floor = graph({"gcs": (1, 48), "haproxy": (1, 10), "floor:Floor": (1, 100)})
    parts = memory.split(forge, floor)
    assert parts["ray"]["pss_mib"] == 60 and parts["ray_floor"]["pss_mib"] == 58
    assert parts["replicas"] == {"processes": 3, "rss_mib": 400, "pss_mib": 400, "uss_mib": 400}
    assert parts["replica_floor_uss_mib"] == 100
    assert parts["replicas_beyond_floor_uss_mib"] == 100  # 400 - 3 x 100
    assert parts["other"]["pss_mib"] == 5


def test_the_tables_name_every_role_and_the_total():
    graph = {
        "roles": {"gcs": {"processes": 1, "rss_mib": 40, "pss_mib": 20, "uss_mib": 10}},
        "total": {"processes": 1, "rss_mib": 40, "pss_mib": 20, "uss_mib": 10},
    }
    text = memory.table("x", graph)
    assert "| gcs | 1 | 40 | 20 | 10 |" in text and "| total | 1 | 40 | 20 | 10 |" in text


def test_it_refuses_to_measure_beside_a_graph_already_on_8000(monkeypatch, capsys):
    monkeypatch.setattr(local_graph, "port_answers", lambda url: True)
    assert memory.main(["--out", str(Path("/nonexistent/never-written.json"))]) == 2
    assert "already answers" in capsys.readouterr().err


def test_rays_daemons_are_known_by_their_binary_not_the_scripts_they_start():
    raylet = [
        "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet",
        "--dashboard_agent_command=/venv/bin/python -u /venv/ray/dashboard/agent.py",
    ]
    assert processes.role_of(raylet) == "raylet"
    assert processes.role_of(["/venv/ray/core/src/ray/gcs/gcs_server", "--log_dir=/tmp"]) == "gcs"
    assert processes.role_of(["/venv/bin/python", "-u", "/venv/ray/dashboard/agent.py"]) == (
        "dashboard-agent"
    )
    assert processes.role_of(["ray::ServeReplica:forge:gateway"]) == "forge:gateway"
    assert processes.role_of(["ray::HAProxyManager.run"]) == "haproxymanager"


def test_the_check_fails_on_a_pool_ingress_that_runs_a_process():
    def graph(ingress_processes: int) -> dict:
        row = {"processes": ingress_processes, "rss_mib": 140, "pss_mib": 86, "uss_mib": 83}
        gateway = {"processes": 1, "rss_mib": 160, "pss_mib": 103, "uss_mib": 99}
        return {"roles": {"forge-pool-primary:ingress": row, "forge:gateway": gateway}}

    assert memory.problems(graph(0)) == []
    [problem] = memory.problems(graph(1))
    assert problem.startswith("forge-pool-primary:ingress runs 1 process")
