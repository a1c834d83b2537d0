"""``serve run configs/local.yaml`` started, awaited and stopped by a tool (the demo, the local
eval gate), as a person at a terminal would, leaving nothing behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from loadtest import traffic

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/local.yaml"
LOCAL_URL = "http://127.0.0.1:8000"  # where configs/local.yaml listens
# configs/local.yaml's demo keys (local only, never deployed; its comments say so).
ALPHA_KEY = "sk-demo-alpha-local-only"
BETA_KEY = "sk-demo-beta-local-only"
ADMIN_KEY = "sk-demo-admin-local-only"
POOL = "primary"


def port_answers(base_url: str) -> bool:
    parts = urlsplit(base_url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), 1.0):
            return True
    except OSError:
        return False


def start_graph(log_path: Path, config: str | Path = CONFIG) -> subprocess.Popen:
    """``serve run`` in a session of its own, so everything it starts (Ray's processes ignore
    SIGINT and stay in the session) can be found and stopped, and a Ctrl-C at the terminal
    reaches only us. ``--address local``: never deploy onto a Ray someone else started.
    ``config``: configs/local.yaml, or a changed copy of it (run from the repository root all
    the same, where its relative paths point)."""
    env = {
        **os.environ,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    # `serve run` waits on its first HTTP proxy, which Serve kills after 5 s (loadtest/inprocess).
    env.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
    env.pop("RAY_ADDRESS", None)
    serve = Path(sys.executable).parent / "serve"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [str(serve), "run", "--address", "local", str(config)],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def session_pids(sid: int) -> list[int]:
    """Processes still running in the session ``serve run`` led (its Ray, HAProxy, workers);
    not zombies, which hold nothing and which only their parent can reap."""
    out = subprocess.run(["ps", "-eo", "pid=,sid=,stat="], capture_output=True, text=True).stdout
    rows = (line.split() for line in out.splitlines() if line.strip())
    return [
        int(pid)
        for pid, session, stat in rows
        if int(session) == sid and int(pid) != os.getpid() and "Z" not in stat
    ]


def stop_graph(proc: subprocess.Popen, *, drain: bool = True) -> list[int]:
    """SIGINT, as a person at the terminal would: ``serve run`` shuts Serve and its own Ray
    down. Then anything left in its session is killed by pid. Returns what had to be killed.

    ``drain=False``, for a drill that has its numbers: everything in the session is killed at
    once. A drain would wait out Serve's hold on each gateway replica under direct ingress
    (``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S``: 5 s in configs/local.yaml, Serve's 30 s
    in a changed copy without it) with no request left to finish."""
    if not drain:
        return _kill_session(proc)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30
    while (left := session_pids(proc.pid)) and time.monotonic() < deadline:
        time.sleep(1)  # Ray's own shutdown is still reaping
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def _kill_session(proc: subprocess.Popen) -> list[int]:
    """SIGKILL to ``serve run`` and every process of its session, then until none is left
    and :8000 is free for the next graph."""
    killed = session_pids(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = session_pids(proc.pid)  # again: a raylet may have forked one meanwhile
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not left and not port_answers(LOCAL_URL):
            break
        time.sleep(0.5)
    return killed


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(base_url: str, proc: subprocess.Popen | None, log: Path, timeout_s: float) -> str:
    """Until ``GET /v1/models`` answers and one chat is served by the primary (the replicas can
    come up after the gateway does). Returns the primary's model."""
    deadline = time.monotonic() + timeout_s
    headers = {"authorization": f"Bearer {ALPHA_KEY}"}
    model = None
    attempt = 0
    with httpx.Client(base_url=base_url, timeout=30, trust_env=False) as http:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"serve run exited ({proc.returncode}):\n{_tail(log)}")
            try:
                if model is None:
                    response = http.get("/v1/models", headers=headers)
                    if response.status_code == 200:
                        model = response.json()["data"][0]["id"]
                        print(f"gateway up; model {model}", flush=True)
                else:
                    attempt += 1
                    body = {
                        "model": model,
                        "messages": [
                            {"role": "user", "content": traffic.prompt_of(8, f"w{attempt}")}
                        ],
                        "max_tokens": 4,
                    }
                    response = http.post("/v1/chat/completions", json=body, headers=headers)
                    if response.headers.get("x-forge-backend") == POOL:
                        return model
            except httpx.HTTPError:
                pass
            time.sleep(1)
    raise TimeoutError(f"{base_url} not ready with the primary after {timeout_s:.0f}s")
