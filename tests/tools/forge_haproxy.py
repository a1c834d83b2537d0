"""Forge's HAProxy, run as Serve runs it, in front of any local port.

The config is Serve's own: Ray 2.60's renderer (``HAProxyApi``, the code Serve's HAProxy manager
runs on every update) with one HTTP application at ``/`` routed to the given servers, no
fallback, and every file in a directory of the caller's. It is started through
``forge-haproxy``'s ``main`` with Serve's arguments (``-db -f CONFIG``), so what listens is what
that program made of the config. ``tests/tools/test_haproxy_loopback.py`` puts it in front of a
server that echoes the headers it gets; ``tests/e2e/test_hostile.py`` in front of the gateway
replicas' own ports.

Ray's renderer is private API: if a Ray upgrade moves it, these tests say so first.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

PROGRAM = "serve_app.tools.haproxy_loopback"
APP = "forge"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render_serve_config(
    directory: Path,
    *,
    front_host: str,
    front_port: int,
    servers: Sequence[tuple[str, int]],
    stats_port: int,
    metrics_port: int,
) -> Path:
    """Serve's HAProxy config for one application at ``/`` on ``servers`` (host, port)."""
    from ray.serve._private.haproxy import (
        BackendConfig,
        HAProxyApi,
        HAProxyConfig,
        ServerConfig,
    )
    from ray.serve.config import HTTPOptions

    config = HAProxyConfig(
        socket_path=str(directory / "admin.sock"),
        server_state_base=str(directory),
        server_state_file=str(directory / "server-state"),
        http_options=HTTPOptions(host=front_host, port=front_port),
        stats_port=stats_port,
        metrics_port=metrics_port,
        metrics_enabled=False,  # no HAProxyManager here to read its per-request log lines
        has_received_routes=True,
        has_received_servers=True,
    )
    backend = BackendConfig(
        name=APP,
        path_prefix="/",
        app_name=APP,
        servers=[
            ServerConfig(name=f"replica-{i}", host=host, port=port)
            for i, (host, port) in enumerate(servers)
        ],
    )
    path = directory / "haproxy.cfg"
    HAProxyApi(config, {APP: backend}, config_file_path=str(path))._generate_config_file_internal()
    return path


@contextlib.contextmanager
def running(
    directory: Path,
    servers: Sequence[tuple[str, int]],
    *,
    ready_s: float = 15,
    environ: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Forge's HAProxy on 127.0.0.1 in front of ``servers``: its URL while it runs.
    ``environ``: settings for ``forge-haproxy`` on top of this process's environment."""
    front_port = free_port()
    path = render_serve_config(
        directory,
        front_host="127.0.0.1",
        front_port=front_port,
        servers=servers,
        stats_port=free_port(),
        metrics_port=free_port(),
    )
    log = (directory / "haproxy.log").open("wb")
    env = {k: v for k, v in os.environ.items() if k != "RAY_SERVE_HAPROXY_BINARY_PATH"}
    env.update(environ or {})
    process = subprocess.Popen(
        [sys.executable, "-m", PROGRAM, "-db", "-f", str(path)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        _wait_for(process, front_port, ready_s, directory / "haproxy.log")
        yield f"http://127.0.0.1:{front_port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _wait_for(process: subprocess.Popen, port: int, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"forge-haproxy exited {process.returncode}: {log.read_text()}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise AssertionError(f"forge-haproxy did not listen on {port} in {timeout_s} s")
