"""What the gateway costs: TTFT, server CPU per request and req/s, gateway vs straight to the
backend, streaming chat, at concurrency 1, 16 and 64, with a zero-delay and a realistic engine.

    python -m loadtest.overhead [--quick] [--out loadtest/results/overhead.json]

The server side (Ray and everything it starts, or the bare backend) is pinned to core 0 and this
load generator to core 1, so "CPU per request" is the server's own. The direct baseline is the
same simulated engine behind the same OpenAI surface, served by uvicorn without Ray
(``python -m serve_app.mock_openai``); the gateway path is client → Serve proxy (or HAProxy,
``--modes gateway-haproxy``, as ``configs/local.yaml`` serves :8000) → gateway replica (full
pipeline) → handle → replica, and each Forge mode also reports the gateway replica's own port.

``--modes litellm`` (or ``--side-by-side``, the issue's comparison in one run) adds LiteLLM's
proxy, installed into a virtualenv of its own (``loadtest.litellm_proxy``; never a dependency
of Forge), in front of the same mock backend as the direct baseline with the same pins (proxy
and backend on core 0, this load generator on core 1), and reports Forge's rows beside it as
ratios. Each server graph's idle memory (RSS and PSS of every process, Ray's included) is
measured after it has been idle a few seconds, at start and again after its load.

One run is one draw on a machine whose speed moves over minutes: ``--rounds N`` runs every
server N times, interleaved, and the side-by-side judges the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest import litellm_proxy
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


def _proc_table() -> tuple[dict[int, list[int]], dict[int, float]]:
    """Children of every process, and each one's user+system CPU seconds."""
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
    return children, cpu


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _graph_pids(roots: list[int], children: dict[int, list[int]]) -> list[int]:
    """Every process of the servers started from ``roots``: their trees, plus any process of
    the same Ray session that was reparented out of them (Ray's own processes name the
    session directory on their command line; its workers are children of the raylet)."""
    seen: set[int] = set()

    def walk(start: int) -> None:
        todo = [start]
        while todo:
            pid = todo.pop()
            if pid in seen:
                continue
            seen.add(pid)
            todo.extend(children.get(pid, []))

    for root in roots:
        walk(root)
    sessions = set()
    for pid in seen:
        for word in _cmdline(pid).split():
            marker = word.find("/session_")
            if marker >= 0:
                sessions.add(word[marker + 1 :].split("/")[0].split(",")[0])
    sessions.discard("session_latest")
    if sessions:
        for pid in [p for kids in children.values() for p in kids]:
            if pid not in seen and any(name in _cmdline(pid) for name in sessions):
                walk(pid)
    return sorted(seen)


def _process_tree_cpu(root: int | list[int]) -> dict[str, float]:
    """User+system CPU seconds of a process tree, by role (Ray names its worker processes)."""
    children, cpu = _proc_table()
    roles: dict[str, float] = {}
    for pid in _graph_pids(root if isinstance(root, list) else [root], children):
        roles[_role(pid)] = roles.get(_role(pid), 0.0) + cpu.get(pid, 0.0)
    return roles


def _kib(path: str, field: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _label(pid: int) -> str:
    """A finer name than the role, for the memory breakdown."""
    role = _role(pid)
    if role != "other":
        return role
    words = _cmdline(pid).split()
    if not words:
        return "other"
    if words[0].startswith("ray::"):  # Ray appends the running method: ray::Actor.method
        return words[0].split(".")[0]
    for word in words[1:4]:
        if word.endswith(".py") or word.startswith("loadtest.") or word.startswith("serve_app."):
            return Path(word).name
    return Path(words[0]).name


def _graph_memory(roots: list[int]) -> dict:
    """RSS (VmRSS) and PSS (smaps_rollup: shared pages split among their sharers, so a sum
    over processes counts them once) of every process of the graph, in MiB, by label."""
    children, _ = _proc_table()
    pids = _graph_pids(roots, children)
    by: dict[str, dict[str, float]] = {}
    total = {"rss_mib": 0.0, "pss_mib": 0.0}
    for pid in pids:
        rss = _kib(f"/proc/{pid}/status", "VmRSS:")
        if rss is None:  # gone, or a kernel thread
            continue
        pss = _kib(f"/proc/{pid}/smaps_rollup", "Pss:")
        entry = by.setdefault(_label(pid), {"processes": 0, "rss_mib": 0.0, "pss_mib": 0.0})
        entry["processes"] += 1
        entry["rss_mib"] += rss / 1024
        total["rss_mib"] += rss / 1024
        if pss is not None:
            entry["pss_mib"] += pss / 1024
            total["pss_mib"] += pss / 1024
    return {
        "processes": sum(int(e["processes"]) for e in by.values()),
        **total,
        "by_label": dict(sorted(by.items(), key=lambda kv: -kv[1]["rss_mib"])),
    }


def _role(pid: int) -> str:
    title = _cmdline(pid)
    if not title:
        return "other"
    for marker, role in (
        (":gateway", "gateway"),
        ("ProxyActor", "proxy"),
        ("HAProxyManager", "proxy"),
        ("haproxy -db", "proxy"),  # the HAProxy binary itself: the :8000 hop in that mode
        (":pool-", "engine"),
        (":scheduler-", "scheduler"),
        ("mock_openai", "engine"),
        ("bin/litellm", "gateway"),  # LiteLLM's proxy: the hop it is compared as
    ):
        if marker in title:
            return role
    return "other"


def _wait_ready(url: str, timeout: float = 90, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode}) before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


class Server:
    """A pinned server process (its whole tree is measured).

    ``argv`` follows this interpreter unless ``python`` is False (then it is the whole command);
    ``env`` is added to this process's environment unless ``inherit_env`` is False. With
    ``log``, the server's output goes to that file (there is then no READY line to read).
    ``cpus``: the cores it is pinned to (taskset's list)."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        python: bool = True,
        inherit_env: bool = True,
        log: Path | None = None,
        cpus: str = "0",
    ) -> None:
        self._log = open(log, "w") if log else None  # closed in stop()
        self.proc = subprocess.Popen(
            ["taskset", "-c", cpus, *([sys.executable] if python else []), *argv],
            stdout=self._log or subprocess.PIPE,
            stderr=subprocess.STDOUT if self._log else subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})} if inherit_env else dict(env or {}),
        )

    def read_ready(self) -> list[str]:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            if line.startswith("READY"):
                return line.split()[1:]
        raise RuntimeError("server exited before it was ready")

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def cpu(self) -> dict[str, float]:
        return _process_tree_cpu(self.pids())

    def memory(self) -> dict:
        return _graph_memory(self.pids())

    def stop(self) -> None:
        graph = _start_times(_graph_pids(self.pids(), _proc_table()[0]))
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        _reap(graph)
        if self._log:
            self._log.close()


def _start_times(pids: list[int]) -> dict[int, str]:
    """Each live process's start time (zombies left out: they are only waiting to be reaped)."""
    times = {}
    for pid in pids:
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z":
                times[pid] = fields[19]
    return times


def _reap(graph: dict[int, str], grace_s: float = 5.0) -> None:
    """Kill what is left of a stopped server's graph (the same processes, by start time: a
    reused pid is left alone) once ``grace_s`` has passed."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [pid for pid, t in _start_times(list(graph)).items() if t == graph[pid]]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    if left:
        print(f"killed {len(left)} leftover server processes: {left}", file=sys.stderr)


class ServerGroup:
    """Several pinned servers measured as one (LiteLLM's proxy and the backend behind it)."""

    def __init__(self, *servers: Server) -> None:
        self.servers = list(servers)

    def pids(self) -> list[int]:
        return [pid for server in self.servers for pid in server.pids()]

    def cpu(self) -> dict[str, float]:
        return _process_tree_cpu(self.pids())

    def memory(self) -> dict:
        return _graph_memory(self.pids())

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


async def _idle_memory(
    server: Server | ServerGroup, label: str, engine: str, when: str, idle_s: float
) -> dict:
    await asyncio.sleep(idle_s)
    entry = {"server": label, "engine": engine, "when": when, "idle_s": idle_s, **server.memory()}
    print(json.dumps({k: v for k, v in entry.items() if k != "by_label"}), flush=True)
    return entry


async def _measure(server: Server | ServerGroup, url: str, concurrency: int, quick: bool) -> dict:
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
    # Each role's share (the proxy: HAProxy and its manager, or Serve's proxy), to tell which
    # process a change moved.
    summary["cpu_ms_per_req_by_role"] = {k: v * 1000 / ok for k, v in sorted(busy.items())}
    return summary


def _mock_argv(port: int, engine: str) -> list[str]:
    return [
        "-m",
        "serve_app.mock_openai",
        "--port",
        str(port),
        "--model",
        "forge-sim",
        "--engine",
        engine,
    ]


async def _run_rows(
    server: Server | ServerGroup,
    urls: dict[str, str],
    engine_name: str,
    concurrencies: list[int],
    quick: bool,
    memory: list[dict],
    idle_s: float,
) -> list[dict]:
    """Every URL at every concurrency, then the graph's idle memory; stops the server."""
    rows = []
    label = next(iter(urls)).removesuffix("+direct-ingress")
    try:
        memory.append(await _idle_memory(server, label, engine_name, "start", idle_s))
        for path, url in urls.items():
            for c in concurrencies:
                summary = await _measure(server, url, c, quick)
                rows.append({"path": path, "engine": engine_name, "concurrency": c, **summary})
                print(json.dumps(rows[-1]), flush=True)
        memory.append(await _idle_memory(server, label, engine_name, "after-load", idle_s))
    finally:
        server.stop()
    return rows


async def _bench_path(
    path: str,
    engine_name: str,
    concurrencies: list[int],
    quick: bool,
    memory: list[dict],
    idle_s: float,
    env: dict[str, str] | None = None,
    redis_url: str | None = None,
    pipeline: str = "full",
) -> list[dict]:
    port = _free_port()
    engine = json.dumps(ENGINES[engine_name])
    if path == "direct":
        server = Server(_mock_argv(port, engine))
        try:
            _wait_ready(f"http://127.0.0.1:{port}/v1/models", proc=server.proc)
        except BaseException:
            server.stop()
            raise
        urls = {"direct": f"http://127.0.0.1:{port}/v1/chat/completions"}
    else:
        argv = ["-m", "loadtest.serve_forge", "--port", str(port), "--engine", engine]
        if redis_url:
            argv += ["--redis-url", redis_url]
        argv += ["--pipeline", pipeline]
        if pipeline != "full":
            path = f"{path} ({pipeline} pipeline)"
        server = Server(argv, env=env)
        try:
            proxy, direct_ingress = server.read_ready()
        except BaseException:
            server.stop()
            raise
        urls = {path: f"{proxy}/v1/chat/completions"}
        if direct_ingress != "-":
            urls[path + "+direct-ingress"] = f"{direct_ingress}/v1/chat/completions"
    return await _run_rows(server, urls, engine_name, concurrencies, quick, memory, idle_s)


async def _bench_litellm(
    engine_name: str,
    concurrencies: list[int],
    quick: bool,
    memory: list[dict],
    idle_s: float,
    venv: Path,
) -> list[dict]:
    """LiteLLM's proxy (1 worker, no database) in front of the direct baseline's backend, both
    pinned to core 0 as Forge's whole graph is; its process is the "gateway" role."""
    backend_port, port = _free_port(), _free_port()
    backend = Server(_mock_argv(backend_port, json.dumps(ENGINES[engine_name])))
    workdir = Path(tempfile.mkdtemp(prefix="forge-litellm-"))
    servers: list[Server] = [backend]
    try:
        _wait_ready(f"http://127.0.0.1:{backend_port}/v1/models", proc=backend.proc)
        config = litellm_proxy.write_config(workdir, backend_port, "forge-sim", BENCH_KEY)
        proxy = Server(
            litellm_proxy.proxy_argv(venv, config, port),
            env=litellm_proxy.proxy_env(),
            python=False,
            inherit_env=False,
            log=workdir / "litellm.log",
        )
        servers.append(proxy)
        began = time.monotonic()
        _wait_ready(f"http://127.0.0.1:{port}/health/liveliness", timeout=300, proc=proxy.proc)
        print(
            f"litellm proxy ready in {time.monotonic() - began:.1f} s (log: {workdir})", flush=True
        )
    except BaseException:
        for server in reversed(servers):
            server.stop()
        raise
    urls = {"litellm": f"http://127.0.0.1:{port}/v1/chat/completions"}
    rows = await _run_rows(
        ServerGroup(*servers), urls, engine_name, concurrencies, quick, memory, idle_s
    )
    shutil.rmtree(workdir, ignore_errors=True)  # kept, with the proxy's log, if it failed
    return rows


# The bar a side-by-side run is judged against (issue 36; issue 12's was 0.4× and 4×).
TTFT_TARGET_MS = 3.0
TTFT_TARGET_RATIO = 0.3  # of LiteLLM's added TTFT at c=1
PER_CORE_TARGET_RATIO = 8.0  # LiteLLM's requests per gateway core-second at c=16


def side_by_side(rows: list[dict]) -> list[dict]:
    """Each Forge row beside LiteLLM's at the same engine and concurrency, as ratios: added
    TTFT p50 (over direct; lower is better) and requests per gateway core-second (higher is
    better), with the targets above.

    With several rounds, each is compared within itself (the servers of one round ran minutes
    apart, not tens of minutes), and an entry holds the median of the rounds' figures, judged
    against the targets, with each round's ratios beside it."""
    rounds = sorted({r.get("round", 0) for r in rows})
    if len(rounds) == 1:
        return _side_by_side_round(rows)
    by_key: dict[tuple, list[dict]] = {}
    for number in rounds:
        for entry in _side_by_side_round([r for r in rows if r.get("round", 0) == number]):
            by_key.setdefault((entry["engine"], entry["path"], entry["concurrency"]), []).append(
                entry
            )
    out = []
    for (engine, path, c), entries in by_key.items():
        median = {
            k: statistics.median(e[k] for e in entries)
            for k, v in entries[0].items()
            if type(v) is float
        }
        entry = {"engine": engine, "path": path, "concurrency": c, **median}
        entry["rounds"] = [
            {k: e[k] for k in ("added_ttft_p50_ms", "added_ttft_ratio", "req_per_core_ratio")}
            for e in entries
        ]
        _judge(entry)
        out.append(entry)
    return out


def _judge(entry: dict) -> None:
    if entry["concurrency"] == 1:
        entry["target_met"] = (
            entry["added_ttft_p50_ms"] <= TTFT_TARGET_MS
            and entry["added_ttft_ratio"] <= TTFT_TARGET_RATIO
        )
    elif entry["concurrency"] == 16:
        entry["target_met"] = entry["req_per_core_ratio"] >= PER_CORE_TARGET_RATIO


def _side_by_side_round(rows: list[dict]) -> list[dict]:
    direct = {(r["engine"], r["concurrency"]): r for r in rows if r["path"] == "direct"}
    litellm = {(r["engine"], r["concurrency"]): r for r in rows if r["path"] == "litellm"}
    out = []
    for r in rows:
        key = (r["engine"], r["concurrency"])
        if r["path"] in ("direct", "litellm") or key not in litellm or key not in direct:
            continue
        ll, base = litellm[key], direct[key]
        added = r["ttft_p50_ms"] - base["ttft_p50_ms"]
        ll_added = ll["ttft_p50_ms"] - base["ttft_p50_ms"]
        per_core, ll_per_core = r["req_per_gateway_core_s"], ll["req_per_gateway_core_s"]
        entry = {
            "engine": r["engine"],
            "path": r["path"],
            "concurrency": r["concurrency"],
            "added_ttft_p50_ms": added,
            "litellm_added_ttft_p50_ms": ll_added,
            "added_ttft_ratio": added / ll_added if ll_added > 0 else float("nan"),
            "req_per_s": r["req_per_s"],
            "litellm_req_per_s": ll["req_per_s"],
            "req_per_s_ratio": r["req_per_s"] / ll["req_per_s"]
            if ll["req_per_s"]
            else float("nan"),
            "req_per_gateway_core_s": per_core,
            "litellm_req_per_gateway_core_s": ll_per_core,
            "req_per_core_ratio": per_core / ll_per_core if ll_per_core else float("nan"),
        }
        _judge(entry)
        out.append(entry)
    return out


def side_by_side_table(entries: list[dict]) -> str:
    lines = [
        "| engine | Forge path | c | added TTFT p50 ms: Forge / LiteLLM | ratio | "
        "req/s: Forge / LiteLLM | ratio | req per gateway core-s: Forge / LiteLLM | ratio | "
        "target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    rounds = any("rounds" in e for e in entries)
    if rounds:  # the figures are medians: each round's judged ratio beside them
        lines[0] += " each round |"
        lines[1] += "---|"
    for e in entries:
        target = {True: "met", False: "missed"}.get(e.get("target_met"), "")
        if target:
            target += (
                f" (≤ {TTFT_TARGET_MS:g} ms, ≤ {TTFT_TARGET_RATIO:g}×)"
                if e["concurrency"] == 1
                else f" (≥ {PER_CORE_TARGET_RATIO:g}× per core)"
            )
        lines.append(
            f"| {e['engine']} | {e['path']} | {e['concurrency']} | "
            f"{e['added_ttft_p50_ms']:.2f} / {e['litellm_added_ttft_p50_ms']:.2f} | "
            f"{e['added_ttft_ratio']:.2f}× | {e['req_per_s']:.0f} / {e['litellm_req_per_s']:.0f} | "
            f"{e['req_per_s_ratio']:.2f}× | {e['req_per_gateway_core_s']:.0f} / "
            f"{e['litellm_req_per_gateway_core_s']:.0f} | {e['req_per_core_ratio']:.2f}× | "
            f"{target} |" + (f" {_round_ratios(e)} |" if rounds else "")
        )
    return "\n".join(lines)


def _round_ratios(entry: dict) -> str:
    field = "added_ttft_ratio" if entry["concurrency"] == 1 else "req_per_core_ratio"
    return " · ".join(f"{r[field]:.2f}×" for r in entry.get("rounds", []))


def memory_table(memory: list[dict]) -> str:
    """Each graph's idle RSS and PSS, whole and without its engine or backend process, and
    as a multiple of LiteLLM's graph's (same engine, same moment) where there is one."""
    litellm = {(m["engine"], m["when"]): m for m in memory if m["server"] == "litellm"}
    lines = [
        "| server graph | engine | when | processes | RSS MiB | PSS MiB | "
        "without engine/backend: RSS / PSS MiB | × LiteLLM's: RSS / PSS (whole) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for m in memory:
        engine = m["by_label"].get("engine", {"rss_mib": 0.0, "pss_mib": 0.0})
        ll = litellm.get((m["engine"], m["when"]))
        ratio = ""
        if ll and m["server"] not in ("litellm", "direct"):
            ratio = f"{m['rss_mib'] / ll['rss_mib']:.1f}× / {m['pss_mib'] / ll['pss_mib']:.1f}×"
        lines.append(
            f"| {m['server']} | {m['engine']} | {m['when']} (idle {m['idle_s']:g} s) | "
            f"{m['processes']} | {m['rss_mib']:.0f} | {m['pss_mib']:.0f} | "
            f"{m['rss_mib'] - engine['rss_mib']:.0f} / {m['pss_mib'] - engine['pss_mib']:.0f} | "
            f"{ratio} |"
        )
    return "\n".join(lines)


def _haproxy_env() -> dict[str, str]:
    """configs/local.yaml's :8000: HAProxy through forge-haproxy (listeners on loopback), on
    ports of its own so a ``serve run`` elsewhere on the machine does not collide."""
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_ENABLE_HA_PROXY": "1",
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(Path(sys.executable).parent / "forge-haproxy"),
        "RAY_SERVE_HAPROXY_STATS_PORT": str(_free_port()),
        "RAY_SERVE_HAPROXY_METRICS_PORT": str(_free_port()),
        "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(_free_port()),
    }


MODES = {
    "gateway": None,
    "gateway-throughput-optimized": {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"},
    "gateway-haproxy": _haproxy_env,  # what configs/local.yaml serves at :8000
    "litellm": None,
}


async def main_async(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    os.sched_setaffinity(0, {1})
    rows: list[dict] = []
    memory: list[dict] = []
    venv = None
    if "litellm" in args.modes:  # before anything is pinned or measured
        venv = litellm_proxy.ensure_venv(args.litellm_venv)
    for number in range(args.rounds):
        # Rounds interleave the servers (direct, Forge, LiteLLM, direct, ...): a machine whose
        # speed drifts over minutes weighs on every server alike, not on whichever ran last.
        # Idle memory is read in the first round only.
        measured = await _round(args, venv, memory if number == 0 else [])
        rows += [{**row, "round": number} for row in measured]
    return rows, memory


async def _round(args: argparse.Namespace, venv: Path | None, memory: list[dict]) -> list[dict]:
    rows: list[dict] = []
    for engine_name in args.engines:
        rows += await _bench_path(
            "direct", engine_name, args.concurrency, args.quick, memory, args.idle_s
        )
        for mode in args.modes:
            if mode == "litellm":
                assert venv is not None
                rows += await _bench_litellm(
                    engine_name, args.concurrency, args.quick, memory, args.idle_s, venv
                )
                continue
            for pipeline in args.pipelines:
                rows += await _bench_path(
                    mode,
                    engine_name,
                    args.concurrency,
                    args.quick,
                    memory,
                    args.idle_s,
                    MODES[mode]() if callable(MODES[mode]) else MODES[mode],
                    args.redis_url,
                    pipeline,
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["gateway", "gateway-throughput-optimized"],
        choices=list(MODES),
        help="litellm: LiteLLM's proxy over the same backend, reported beside Forge as ratios",
    )
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--out", default="loadtest/results/overhead.json")
    parser.add_argument("--redis-url", default=None, help="gateway store (embedded without)")
    parser.add_argument(
        "--pipelines",
        nargs="+",
        default=["full"],
        choices=["full", "unmetered", "quota", "bare"],
        help="which stages run: all; all but metering and the cache; all but admission; "
        "neither quota nor admission",
    )
    parser.add_argument(
        "--side-by-side",
        action="store_true",
        help="the issue's comparison: zero engine, c=1 and 16, full pipeline, Forge as "
        "configs/local.yaml serves it (:8000 via HAProxy, and direct ingress) and LiteLLM in "
        "one run, quota on "
        "Redis at 127.0.0.1:6379 unless --redis-url says otherwise",
    )
    parser.add_argument(
        "--litellm-venv",
        type=Path,
        default=litellm_proxy.DEFAULT_VENV,
        help=f"LiteLLM's own virtualenv, made if missing (litellm[proxy]=="
        f"{litellm_proxy.LITELLM_VERSION})",
    )
    parser.add_argument(
        "--idle-s", type=float, default=3.0, help="idle time before each memory reading"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every server this many times, interleaved; the side-by-side verdict is then "
        "on the median of the rounds' figures",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    if args.side_by_side:
        args.engines, args.concurrency, args.pipelines = ["zero"], [1, 16], ["full"]
        args.modes = ["gateway-haproxy", "litellm"]
        args.redis_url = args.redis_url or "redis://127.0.0.1:6379/0"
        if args.out == parser.get_default("out"):
            args.out = "loadtest/results/side-by-side.json"
    rows, memory = asyncio.run(main_async(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "command": " ".join(["python -m loadtest.overhead", *sys.argv[1:]]),
    }
    if "litellm" in args.modes:
        meta["litellm"] = litellm_proxy.installed_version(args.litellm_venv)
    data: dict = {"meta": meta, "rows": rows, "idle_memory": memory}
    comparison = side_by_side(rows)
    if comparison:
        data["side_by_side"] = comparison
    out.write_text(json.dumps(data, indent=2))
    from loadtest.report import overhead_table

    print(overhead_table(data))
    if comparison:
        print(f"\nForge beside LiteLLM {meta.get('litellm')} (same run, same backend and pins):\n")
        print(side_by_side_table(comparison))
    print("\nIdle memory of each server graph (every process, Ray's included):\n")
    print(memory_table(memory))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
