"""The GuideLLM benchmark's own parts: its bare-engine baseline is the laptop pool's engine, the
mock it serves takes what GuideLLM sends, and its ``--check`` fails the runs it should (the
benchmark itself runs in CI's documented commands, GuideLLM in a virtualenv of its own)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from loadtest import guidellm_bench, local_graph
from loadtest.inprocess import free_port


def test_the_baseline_engine_is_the_primary_pools_with_the_whole_pools_batch():
    apps = yaml.safe_load((local_graph.REPO / local_graph.CONFIG).read_text())["applications"]
    pool = next(a for a in apps if a["name"] == "forge-pool-primary")["args"]["pool"]
    engine = guidellm_bench.primary_engine()
    replicas = pool["deployment"]["num_replicas"]
    assert engine["max_num_seqs"] == pool["engine"]["max_num_seqs"] * replicas
    timings = {k: v for k, v in pool["engine"].items() if k.endswith("_s")}
    assert timings and all(engine[k] == v for k, v in timings.items())


def test_the_scenario_names_the_key_only_where_one_is_given():
    args = argparse.Namespace(rate=4.0, prompt_tokens=256, output_tokens=64, requests=10)
    tok = Path("/tmp/tok")
    bare = guidellm_bench.scenario("http://127.0.0.1:9", None, "synchronous", args, tok)["spec"]
    assert "api_key" not in bare["backend"] and bare["profile"] == {"kind": "synchronous"}
    key = "forge-test-key"  # pragma: allowlist secret
    keyed = guidellm_bench.scenario("http://127.0.0.1:9", key, "constant", args, tok)["spec"]
    assert keyed["backend"]["api_key"] == key
    assert keyed["profile"] == {"kind": "constant", "rate": 4.0}
    assert keyed["constraints"] == [{"kind": "max_requests", "count": 10}]
    assert keyed["data"][0]["output_tokens"] == 64


GOOD = {
    "completed": 10,
    "errored": 0,
    "incomplete": 0,
    "cancelled": 0,
    "in_flight_at_end": 0,
    "output_tokens": [64],
}
OURS = {"ok": 10, "errors": 0}


def _results(**changes) -> dict:
    target = {"guidellm_synchronous": dict(GOOD), "guidellm_constant": dict(GOOD), "ours_c1": OURS}
    results = {"mock": json.loads(json.dumps(target)), "forge": json.loads(json.dumps(target))}
    for path, value in changes.items():
        where, row, key = path.split("__")
        results[where][row][key] = value
    return results


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (
            {"forge__guidellm_constant__errored": 1},
            "forge guidellm_constant: 10 of 10 completed, 1 errored",
        ),
        ({"mock__guidellm_synchronous__incomplete": 2}, "2 cut"),
        ({"mock__guidellm_constant__completed": 9}, "9 of 10 completed"),
        ({"forge__guidellm_synchronous__output_tokens": [63, 64]}, "output tokens [63, 64]"),
        ({"forge__ours_c1__errors": 3}, "forge ours_c1: 3 errors"),
    ],
)
def test_the_check_names_an_errored_cut_or_short_run(change, named):
    assert guidellm_bench.problems(_results(), 10, 64) == []
    found = guidellm_bench.problems(_results(**change), 10, 64)
    assert len(found) == 1 and named in found[0], found


def test_a_run_guidellm_ended_with_its_last_request_streaming_is_accounted_for():
    ended = _results(forge__guidellm_constant__completed=9)
    ended["forge"]["guidellm_constant"]["in_flight_at_end"] = 1
    assert guidellm_bench.problems(ended, 10, 64) == []


def test_the_bare_mock_takes_vllms_sampling_extensions_only_when_asked():
    """GuideLLM sends ``ignore_eos``; the mock as the fallback refuses it, as Gemini does."""
    body = {
        "model": "forge-sim-1b",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "ignore_eos": True,
    }
    statuses = {}
    for flags in ([], ["--vllm-params"]):
        port = free_port()
        argv = [sys.executable, "-m", "serve_app.mock_openai", "--port", str(port)]
        proc = subprocess.Popen([*argv, "--model", "forge-sim-1b", *flags])
        try:
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            deadline = time.monotonic() + 30
            while True:
                try:
                    response = httpx.post(url, json=body, timeout=5, trust_env=False)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and proc.poll() is None
                    time.sleep(0.2)
            statuses[bool(flags)] = response.status_code
            if flags:
                assert response.json()["usage"]["completion_tokens"] == 3
            else:
                assert response.json()["error"]["param"] == "ignore_eos"
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    assert statuses == {False: 400, True: 200}
