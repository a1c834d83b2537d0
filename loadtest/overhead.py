"""What the gateway costs: TTFT, server CPU per request and req/s, gateway vs straight to the
backend, streaming chat, at concurrency 1, 16 and 64, with a zero-delay and a realistic engine.

    python -m loadtest.overhead [--quick] [--out loadtest/results/overhead.json]

The server side (Ray and everything it starts, or the bare backend) is pinned to core 0 and this
load generator to core 1, so "CPU per request" is the server's own. The direct baseline is the
same simulated engine behind the same OpenAI surface, served by uvicorn without Ray
(``python -m serve_app.mock_openai``); the gateway path is client → Serve proxy → gateway
replica (full pipeline) → handle → replica.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtest.http_load import closed_loop
from loadtest.serve_forge import BENCH_KEY

ENGINES = {
    "zero": {"output_tokens_min": 16, "output_tokens_max": 16, "max_num_seqs": 256},
    "realistic": {
        "max_num_seqs": 64,
        "prefill_base_s": 0.02,
        "prefill_per_token_s": 0.0001,
        "decode_base_s": 0.01,
        "decode_per_seq_s": 0.0005,
        "output_tokens_min": 16,
        "output_tokens_max": 16,
    },
}
BODY = {
    "model": "forge-sim",
    "messages": [{"role": "user", "content": "Say sixteen words about gateways."}],
    "max_tokens": 16,
    "stream": True,
}
_TICK = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _process_tree_cpu(root: int) -> dict[str, float]:
    """User+system CPU seconds of a process tree, by role (Ray names its worker processes)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid, ppid = int(entry.name), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        cpu[pid] = (int(fields[11]) + int(fields[12])) / _TICK
    roles: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        roles[_role(pid)] = roles.get(_role(pid), 0.0) + cpu.get(pid, 0.0)
    return roles


def _role(pid: int) -> str:
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "other"
    for marker, role in (
        (":gateway", "gateway"),
        ("ProxyActor", "proxy"),
        (":pool-", "engine"),
        (":scheduler-", "scheduler"),
        ("mock_openai", "engine"),
    ):
        if marker in title:
            return role
    return "other"


def _wait_ready(url: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


class Server:
    """A pinned server process (its whole tree is measured)."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            ["taskset", "-c", "0", sys.executable, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def read_ready(self) -> list[str]:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith("READY"):
                return line.split()[1:]
        raise RuntimeError("server exited before it was ready")

    def cpu(self) -> dict[str, float]:
        return _process_tree_cpu(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _measure(server: Server, url: str, concurrency: int, quick: bool) -> dict:
    # Warm up (connections, Serve's routers, the engine's caches).
    await closed_loop(
        url, BODY, concurrency=concurrency, requests=concurrency * 3, api_key=BENCH_KEY
    )
    # What the server burns doing nothing (Ray's control plane polls): subtracted below.
    idle0 = server.cpu()
    await asyncio.sleep(2)
    idle_rate = {k: (v - idle0.get(k, 0.0)) / 2 for k, v in server.cpu().items()}
    cpu0 = server.cpu()
    if concurrency == 1:
        run = await closed_loop(
            url, BODY, concurrency=1, requests=40 if quick else 150, api_key=BENCH_KEY
        )
    else:
        run = await closed_loop(
            url, BODY, concurrency=concurrency, duration_s=4 if quick else 10, api_key=BENCH_KEY
        )
    cpu1 = server.cpu()
    busy = {
        k: max(0.0, v - cpu0.get(k, 0.0) - idle_rate.get(k, 0.0) * run.wall_s)
        for k, v in cpu1.items()
    }
    summary = run.summary()
    ok = max(1, summary["ok"])
    hop = busy.get("gateway", 0.0) + busy.get("proxy", 0.0) + busy.get("scheduler", 0.0)
    summary["server_cpu_ms_per_req"] = sum(busy.values()) * 1000 / ok
    summary["gateway_cpu_ms_per_req"] = hop * 1000 / ok  # gateway (+ proxy, scheduler)
    summary["engine_cpu_ms_per_req"] = busy.get("engine", 0.0) * 1000 / ok
    summary["req_per_gateway_core_s"] = ok / hop if hop else float("nan")
    return summary


async def _bench_path(
    path: str,
    engine_name: str,
    concurrencies: list[int],
    quick: bool,
    env: dict[str, str] | None = None,
    redis_url: str | None = None,
    pipeline: str = "full",
) -> list[dict]:
    port = _free_port()
    engine = json.dumps(ENGINES[engine_name])
    if path == "direct":
        server = Server(
            [
                "-m",
                "serve_app.mock_openai",
                "--port",
                str(port),
                "--model",
                "forge-sim",
                "--engine",
                engine,
            ]
        )
        _wait_ready(f"http://127.0.0.1:{port}/v1/models")
        urls = {"direct": f"http://127.0.0.1:{port}/v1/chat/completions"}
    else:
        argv = ["-m", "loadtest.serve_forge", "--port", str(port), "--engine", engine]
        if redis_url:
            argv += ["--redis-url", redis_url]
        argv += ["--pipeline", pipeline]
        if pipeline != "full":
            path = f"{path} ({pipeline} pipeline)"
        server = Server(argv, env=env)
        proxy, direct_ingress = server.read_ready()
        urls = {path: f"{proxy}/v1/chat/completions"}
        if direct_ingress != "-":
            urls[path + "+direct-ingress"] = f"{direct_ingress}/v1/chat/completions"
    rows = []
    try:
        for label, url in urls.items():
            for c in concurrencies:
                summary = await _measure(server, url, c, quick)
                rows.append({"path": label, "engine": engine_name, "concurrency": c, **summary})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        server.stop()
    return rows


async def main_async(args: argparse.Namespace) -> list[dict]:
    os.sched_setaffinity(0, {1})
    rows: list[dict] = []
    modes = {
        "gateway": None,
        "gateway-throughput-optimized": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
    }
    for engine_name in args.engines:
        rows += await _bench_path("direct", engine_name, args.concurrency, args.quick)
        for mode in args.modes:
            for pipeline in args.pipelines:
                rows += await _bench_path(
                    mode,
                    engine_name,
                    args.concurrency,
                    args.quick,
                    modes[mode],
                    args.redis_url,
                    pipeline,
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--modes", nargs="+", default=["gateway", "gateway-throughput-optimized"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--out", default="loadtest/results/overhead.json")
    parser.add_argument("--redis-url", default=None, help="gateway store (embedded without)")
    parser.add_argument(
        "--pipelines",
        nargs="+",
        default=["full"],
        choices=["full", "quota", "bare"],
        help="which stages run: all, all but admission, neither quota nor admission",
    )
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "command": " ".join(["python -m loadtest.overhead", *sys.argv[1:]]),
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
