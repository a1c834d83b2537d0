"""Start Forge inside this process for a drill, so the drill can also read its replicas."""

from __future__ import annotations

import os
import socket
import time

import httpx

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")

APP = "forge"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_port: int | None = None


def start_forge(args: dict, *, reuse: bool = False) -> str:
    """Run Forge with these ``args``; returns the cheapest URL to drive it (direct ingress).

    ``reuse``: deploy into the Ray instance an earlier call started (drills that compare several
    configs one after another).
    """
    import ray
    from ray import serve

    from serve_app import replica_admin
    from serve_app.app import build_app

    global _port
    if not (reuse and ray.is_initialized()):
        ray.init(
            num_cpus=2,
            object_store_memory=100 * 1024 * 1024,
            include_dashboard=False,
            log_to_driver=False,
        )
        _port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": _port})
    port = _port
    serve.run(build_app(args), name=APP, route_prefix="/")
    url = replica_admin.direct_ingress_url(APP) or f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("Forge did not become ready")


def stop_forge() -> None:
    import ray

    ray.shutdown()
