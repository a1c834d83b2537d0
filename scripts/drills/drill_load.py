"""Steady load for the cluster drills, and the table they print.

    python drill_load.py run --url http://forge-serve:8000 --duration 900   # in the Job
    python drill_load.py report LOG --event-at EPOCH [--event NAME]             # on your machine

``run`` (the in-cluster Job, scripts/drills/load-job.yaml) keeps ``--concurrency`` closed-loop
streaming chat completions going against the Serve entry point for ``--duration`` seconds and
prints one JSON line per request: wall-clock start and end, status, ``x-forge-backend`` (the pool,
``fallback`` or ``cache``), whether the stream ended with an SSE error event, time to first token.
The key comes from ``FORGE_DRILL_KEY`` (a Secret), never from the command line.

``report`` reads those lines (``kubectl logs``) and prints the seed system's drill table
(loadtest/failover.py's columns): requests, served by the fallback, 5xx, client-visible errors and
total latency p50/p95, for the minutes before the event, the minutes after it, and per minute
around it, so recovery is visible. It needs only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from pathlib import Path

PREFIX = "DRILL "  # marks request lines in the Job's log


def run(url: str, duration: float, concurrency: int, model: str, max_tokens: int) -> int:
    import httpx  # in the gateway image (a Forge dependency); `report` does not need it

    key = os.environ.get("FORGE_DRILL_KEY")
    if not key:
        sys.exit("FORGE_DRILL_KEY is not set (the Job reads it from a Secret)")
    until = time.time() + duration
    lock = threading.Lock()

    def client(worker: int) -> None:
        headers = {"authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, timeout=httpx.Timeout(180, connect=5)) as http:
            n = 0
            while time.time() < until:
                n += 1
                # Not temperature 0, and a fresh nonce: the response cache must not answer these.
                body = {
                    "model": model,
                    "messages": [
                        {
                            "role": "user",
                            "content": f"drill {worker}-{n} {uuid.uuid4().hex[:8]}: "
                            "name three uses of a GPU, one line each.",
                        }
                    ],
                    "max_tokens": max_tokens,
                    "temperature": 0.7,
                    "stream": True,
                }
                start = time.time()
                ttft = None
                status, backend, error_event, error = 0, "none", False, None
                try:
                    with http.stream(
                        "POST", "/v1/chat/completions", json=body, headers=headers
                    ) as response:
                        status = response.status_code
                        backend = response.headers.get("x-forge-backend") or "none"
                        last = ""
                        for line in response.iter_lines():
                            if line.startswith("data: "):
                                if ttft is None:
                                    ttft = time.time() - start
                                if line != "data: [DONE]":
                                    last = line
                        error_event = status == 200 and '"error"' in last
                except httpx.HTTPError as exc:
                    error = type(exc).__name__
                sample = {
                    "start": round(start, 3),
                    "end": round(time.time(), 3),
                    "status": status,
                    "backend": backend,
                    "error_event": error_event,
                    "ttft": None if ttft is None else round(ttft, 3),
                    "error": error,
                }
                with lock:
                    print(PREFIX + json.dumps(sample), flush=True)
                if status == 0:
                    time.sleep(0.5)  # a refused connection is instant: do not spin

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 0


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


def row(samples: list[dict]) -> dict:
    ok = sorted(s["end"] - s["start"] for s in samples if s["status"] == 200)
    p50, p95 = _pct(ok, 50), _pct(ok, 95)
    return {
        "requests": len(samples),
        "served_by_fallback": sum(s["backend"] == "fallback" for s in samples),
        "5xx": sum(s["status"] >= 500 for s in samples),
        "client_visible_errors": sum(s["status"] != 200 or s["error_event"] for s in samples),
        "total_p50_ms": None if p50 is None else round(p50 * 1000),
        "total_p95_ms": None if p95 is None else round(p95 * 1000),
    }


def table(samples: list[dict], event_at: float, bucket_s: float = 60.0) -> list[tuple[str, dict]]:
    """Rows: before the event, after it, all; then one per ``bucket_s`` around it."""
    rows = [
        ("before", row([s for s in samples if s["start"] < event_at])),
        ("after", row([s for s in samples if s["start"] >= event_at])),
        ("all", row(samples)),
    ]
    if samples:
        first = int((min(s["start"] for s in samples) - event_at) // bucket_s)
        last = int((max(s["start"] for s in samples) - event_at) // bucket_s)
        for b in range(first, last + 1):
            lo = event_at + b * bucket_s
            chosen = [s for s in samples if lo <= s["start"] < lo + bucket_s]
            label = f"{b * bucket_s:+.0f}s..{(b + 1) * bucket_s:+.0f}s"
            rows.append((label, row(chosen)))
    return rows


def render(rows: list[tuple[str, dict]], title: str) -> str:
    columns = list(rows[0][1]) if rows else []
    head = ["window", *columns]
    body = [[name, *("-" if r[c] is None else str(r[c]) for c in columns)] for name, r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=False)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip() for r in body]
    return "\n".join(lines)


def read_samples(lines: list[str]) -> list[dict]:
    return [json.loads(line[len(PREFIX) :]) for line in lines if line.startswith(PREFIX)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="generate the load (in the cluster)")
    r.add_argument("--url", required=True, help="the Serve entry point, e.g. http://svc:8000")
    r.add_argument("--duration", type=float, default=900)
    r.add_argument("--concurrency", type=int, default=8)
    r.add_argument("--model", default="qwen2.5-3b-instruct")
    r.add_argument("--max-tokens", type=int, default=64)
    p = sub.add_parser("report", help="print the drill table from the Job's log")
    p.add_argument("log", help="the Job's log (kubectl logs), or - for stdin")
    p.add_argument("--event-at", type=float, required=True, help="epoch seconds of the event")
    p.add_argument("--event", default="event", help="what happened, for the title")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    args = parser.parse_args()
    if args.command == "run":
        return run(args.url, args.duration, args.concurrency, args.model, args.max_tokens)
    text = sys.stdin.read() if args.log == "-" else Path(args.log).read_text()
    samples = read_samples(text.splitlines())
    if not samples:
        print("no request lines in the log: did the load Job run?", file=sys.stderr)
        return 1
    rows = table(samples, args.event_at)
    if args.json:
        print(json.dumps(dict(rows), indent=1))
    else:
        when = time.strftime("%H:%M:%S", time.gmtime(args.event_at))
        print(render(rows, f"{args.event} at {when} UTC"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
