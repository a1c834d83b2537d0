"""What the gateway adds per request in front of a real vLLM: p50 TTFT and total time of
sequential streaming chat requests, straight to vLLM's own OpenAI server vs through Forge.

    python -m loadtest.vllm_overhead [--requests 100] [--model PATH]
                                     [--out loadtest/results/vllm_overhead.json]

Runs in the vLLM virtualenv (scripts/install-vllm-cpu.sh), on the tiny offline model (built into
a temporary directory unless --model names one). Both sides run the same vLLM engine arguments:
``python -m vllm.entrypoints.openai.api_server``, and Forge (``loadtest.serve_forge``: full
pipeline, one vLLM replica) through the Serve proxy and through the gateway replica's
direct-ingress port. Requests are sequential (concurrency 1), so the difference is the
per-request path, not queueing; the paths take turns, one request each, so load from anything
else on the machine falls on all of them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

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


def measure_interleaved(paths: dict[str, tuple[str, dict]], requests: int, warmup: int = 10):
    """One request per path in turn, ``requests`` rounds: whatever else the machine does at a
    moment, every path sees the same of it."""
    samples: dict[str, list[tuple[float, float, int]]] = {name: [] for name in paths}
    with httpx.Client(timeout=60) as client:
        for url, headers in paths.values():
            for _ in range(warmup):
                one_request(client, url, headers)
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
        _wait_healthy(f"{self.url}/health")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


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
            stderr=subprocess.DEVNULL,
            text=True,
        )

    def wait(self) -> tuple[str, str]:
        """(proxy URL, direct-ingress URL or "-") once Forge serves. The replica loads vLLM in
        its constructor, so by then the primary pool serves, not the fallback."""
        for line in self.proc.stdout:
            if line.startswith("READY"):
                _, proxy_url, direct_url = line.split()
                return proxy_url, direct_url
        raise RuntimeError("Forge exited before it served")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--model", help="a tiny model directory (built if omitted)")
    parser.add_argument("--out", default="loadtest/results/vllm_overhead.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        model_path = args.model
        if model_path is None:
            from serve_app.tools import tiny_model

            model_path = str(tiny_model.build(Path(scratch) / "tiny-model"))
        vllm_server, forge = VLLMServer(model_path), ForgeServer(model_path)
        try:
            vllm_server.wait()
            proxy_url, direct_url = forge.wait()
            forge_headers = {"authorization": f"Bearer {BENCH_KEY}"}
            paths = {
                "vllm_server": (vllm_server.url, {}),
                "forge_proxy": (proxy_url, forge_headers),
            }
            if direct_url != "-":
                paths["forge_direct_ingress"] = (direct_url, forge_headers)
            results = measure_interleaved(paths, args.requests)
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
        # Other work on the machine skews latency: say how busy it was at the end.
        "load_average_1m_5m_15m": [round(x, 2) for x in os.getloadavg()],
        "vllm": vllm.__version__,
        "max_tokens": MAX_TOKENS,
        "results": results,
    }
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


if __name__ == "__main__":
    main()
