"""What the response cache buys on a hit and costs on a miss, against a running Forge.

    serve run configs/local.yaml            # in another terminal
    python -m loadtest.cache_latency --json loadtest/results/cache-latency.json

Three kinds of streamed request, each prompt new unless it is a repeat, sent in rounds that
interleave them (so drift in the machine's speed hits all three alike):

- ``bypass``: ``temperature`` 0.7, never looked up: the path without a cache;
- ``miss``: ``temperature`` 0, a prompt never seen: a lookup that misses, its text gathered, the
  answer stored after it ends; ``miss - bypass`` is the cache's cost on a miss;
- ``hit``: a ``miss`` prompt again: answered from the store, no slot, no engine.

Each worker of ``--concurrency`` runs its own requests over one keep-alive connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
import uuid
from urllib.parse import urlsplit

import orjson

from loadtest.http_load import Connection, RunResult

DEMO_KEY = "sk-demo-alpha-local-only"  # configs/local.yaml's demo tenant
_HIT_CHUNKS = 4


def _body(model: str, prompt: str, temperature: float, max_tokens: int) -> bytes:
    return orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": temperature,
            "max_tokens": max_tokens,
            "stream": True,
        }
    )


async def _worker(
    url: str, key: str, model: str, rounds: int, max_tokens: int, results: dict[str, RunResult]
) -> None:
    parts = urlsplit(url)
    conn = Connection(parts.hostname or "127.0.0.1", parts.port or 80)
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    run = uuid.uuid4().hex[:8]
    try:
        for i in range(rounds):
            prompt = f"cache benchmark {run} prompt {i}: what does a gateway cache?"
            for kind, temperature, text in (
                ("bypass", 0.7, prompt + " (sampled)"),
                ("miss", 0.0, prompt),
            ):
                sample = await conn.request(
                    "POST", parts.path, headers, _body(model, text, temperature, max_tokens)
                )
                results[kind].samples.append(sample)
            await asyncio.sleep(0.02)  # the miss's entry is stored once its response has ended
            sample = await conn.request(
                "POST", parts.path, headers, _body(model, prompt, 0.0, max_tokens)
            )
            # A replayed answer is three chunks and [DONE]; a generated one has one per token.
            results["hit" if sample.chunks <= _HIT_CHUNKS else "late"].samples.append(sample)
    finally:
        conn.close()


async def measure(
    url: str, key: str, model: str, concurrency: int, rounds: int, max_tokens: int
) -> dict:
    # "late": a repeat that came before its entry was stored (served, and not counted as a hit)
    results = {kind: RunResult() for kind in ("bypass", "miss", "hit", "late")}
    began = time.perf_counter()
    await asyncio.gather(
        *(_worker(url, key, model, rounds, max_tokens, results) for _ in range(concurrency))
    )
    wall = time.perf_counter() - began
    for result in results.values():
        result.wall_s = wall
    return {kind: result.summary() for kind, result in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1/chat/completions")
    parser.add_argument("--key", default=DEMO_KEY)
    parser.add_argument("--model", default="forge-sim-1b")
    parser.add_argument("--rounds", type=int, default=100, help="per worker")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rows = []
    for concurrency in args.concurrency:
        summary = asyncio.run(
            measure(args.url, args.key, args.model, concurrency, args.rounds, args.max_tokens)
        )
        rows.append({"concurrency": concurrency, **summary})
        print(f"concurrency {concurrency}")
        for kind in ("bypass", "miss", "hit", "late"):
            s = summary[kind]
            if not s["requests"]:
                continue
            print(
                f"  {kind:6} ok {s['ok']:4}/{s['requests']:<4} TTFT p50 {s['ttft_p50_ms']:7.2f} ms"
                f"  p95 {s['ttft_p95_ms']:7.2f} ms   total p50 {s['total_p50_ms']:7.2f} ms"
            )
    if args.json:
        meta = {"url": args.url, "model": args.model, "max_tokens": args.max_tokens}
        meta |= {"rounds_per_worker": args.rounds, "host": platform.node()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
