"""The cluster runs Serve in the mode the suite and the benchmarks measure.

Throughput-optimized mode changes how deployments talk (gRPC), where user code runs and how
HTTP reaches the gateway (direct ingress). tests/conftest.py runs the suite in it; a cluster
config that left it out would run a Serve nobody tested (issue: configs/gke.yaml did)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODE = "RAY_SERVE_THROUGHPUT_OPTIMIZED"


def _processes(config: dict) -> dict[str, dict]:
    """Each Serve process group's env vars: the controller (and proxies), every application."""
    envs = {"controller": config["controller_options"]["runtime_env"]["env_vars"]}
    for app in config["applications"]:
        envs[app["name"]] = app.get("runtime_env", {}).get("env_vars", {})
    return envs


@pytest.mark.parametrize("name", ["gke.yaml", "local.yaml", "local-vllm.yaml"])
def test_every_process_runs_the_mode_the_suite_runs(name):
    with (CONFIGS / name).open() as f:
        config = yaml.safe_load(f)
    suite_mode = os.environ.get(MODE, "1")  # tests/conftest.py's default
    envs = _processes(config)
    assert {app: env.get(MODE) for app, env in envs.items()} == dict.fromkeys(envs, suite_mode)
