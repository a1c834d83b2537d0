"""Start Forge inside this process for a drill, so the drill can also read its replicas."""

from __future__ import annotations

import os
import socket
import time

import httpx

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
# Serve gives a starting HTTP proxy 5 s to answer, counted from the request to start its actor,
# then kills it, and `serve.start` fails on the dead actor although the controller starts another.
# On two busy cores (CI runs the soak beside vLLM's tests) a new worker process takes longer.
os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")

APP = "forge"


def without_ingress_drain() -> None:
    """For a drill that deletes its graph between runs and waits for it. Under direct ingress,
    Serve holds a stopping ingress replica open 30 s, so that a load balancer in front can
    deregister it first (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``). Between a drill's
    runs nobody sends it a request, and no load balancer is in front, so that hold is only a
    wait. Call before Ray starts (its processes read it when they start). Not for the tests:
    they hold a stopping gateway replica as configs/local.yaml does (5 s, tests/conftest.py)."""
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_port: int | None = None
# Where Ray's metrics agent serves every process's metrics (Prometheus text) while Ray runs.
metrics_port: int | None = None


def _start_ray_and_proxy() -> int:
    import ray
    from ray import serve

    global metrics_port
    metrics_port = free_port()
    ray.init(
        num_cpus=2,
        object_store_memory=100 * 1024 * 1024,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
        _system_config={"metrics_report_interval_ms": 1000},
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def wait_ready(url: str, ready=lambda backends: True, timeout_s: float = 60.0) -> None:
    """Until ``/readyz`` is 200 and ``ready(its backends map)`` holds. Forge is ready as soon
    as the fallback is; drills and tests usually need their pools up too."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = httpx.get(f"{url}/readyz", timeout=2)
            if answer.status_code == 200 and ready(answer.json()["backends"]):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"Forge at {url} did not become ready in {timeout_s:g} s")


def every_backend(backends: dict[str, bool]) -> bool:
    return all(backends.values())


def start_forge(
    args: dict,
    *,
    reuse: bool = False,
    ready=lambda backends: True,
    timeout_s: float = 60.0,
) -> str:
    """Run Forge with these ``args``; returns the cheapest URL to drive it (direct ingress).

    ``reuse``: deploy into the Ray instance an earlier call started (drills that compare several
    configs one after another). ``ready`` and ``timeout_s``: as ``wait_ready``'s (a vLLM pool
    needs its replicas up, which takes longer than the fallback).
    """
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.replica import admin as replica_admin

    global _port
    if not (reuse and ray.is_initialized()):
        _port = _start_ray_and_proxy()
    serve.run(build_app(args), name=APP, route_prefix="/")
    wait_ready(f"http://127.0.0.1:{_port}", ready, timeout_s)
    return replica_admin.direct_ingress_url(APP) or f"http://127.0.0.1:{_port}"


def stop_forge() -> None:
    import ray

    ray.shutdown()


def start_forge_with_mock(make_args, mock_engine: dict | None = None) -> str:
    """Ray, Serve's proxy, the mock fallback at ``/mock`` and Forge built by ``make_args(port)``;
    returns the proxy's URL (which spreads requests over every gateway replica) once every
    backend is ready, not just the first."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.mock_openai import build_mock

    global _port
    _port = _start_ray_and_proxy()
    mock = build_mock({"model": "mock-gemini", "engine": mock_engine or {}})
    serve.run(mock, name="mock-fallback", route_prefix="/mock")
    serve.run(build_app(make_args(_port)), name=APP, route_prefix="/")
    url = f"http://127.0.0.1:{_port}"
    wait_ready(url, every_backend)
    return url
