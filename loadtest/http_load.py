"""A lean closed-loop HTTP/1.1 load generator for streaming (SSE) and JSON endpoints.

httpx or aiohttp on the client side would eat the very core we measure with; this speaks just
enough HTTP/1.1 (keep-alive, chunked and sized bodies) over asyncio streams to time the first
byte of the answer and its end, at a few microseconds of client CPU per chunk.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import orjson


@dataclass
class Sample:
    started: float
    ttft: float  # seconds to the first body byte that carries an SSE data frame
    total: float
    status: int
    chunks: int


@dataclass
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0

    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.status == 200]

    def summary(self) -> dict:
        ok = self.ok()
        ttft = sorted(s.ttft for s in ok)
        total = sorted(s.total for s in ok)
        return {
            "requests": len(self.samples),
            "ok": len(ok),
            "errors": self.errors + len(self.samples) - len(ok),
            "req_per_s": len(ok) / self.wall_s if self.wall_s else 0.0,
            "ttft_p50_ms": _pct(ttft, 50) * 1000,
            "ttft_p95_ms": _pct(ttft, 95) * 1000,
            "total_p50_ms": _pct(total, 50) * 1000,
            "total_p95_ms": _pct(total, 95) * 1000,
            "chunks_mean": statistics.fmean(s.chunks for s in ok) if ok else 0.0,
        }


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    k = min(len(values) - 1, max(0, round(p / 100 * (len(values) - 1))))
    return values[k]


class Connection:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def request(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Sample:
        if self.writer is None:
            await self._open()
        assert self.reader is not None and self.writer is not None
        head = [f"{method} {path} HTTP/1.1", f"host: {self.host}:{self.port}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head.append(f"content-length: {len(body)}")
        started = time.perf_counter()
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        reader = self.reader
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("connection closed by server")
        status = int(status_line.split()[1])
        length, chunked, close = None, False, False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "connection" and value == "close":
                close = True
        ttft, chunks = None, 0
        if chunked:
            while True:
                size_line = await reader.readline()
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    await reader.readline()
                    break
                data = await reader.readexactly(size + 2)
                if ttft is None and b"data: " in data:
                    ttft = time.perf_counter() - started
                chunks += data.count(b"data: ")
        elif length:
            data = await reader.readexactly(length)
            ttft = time.perf_counter() - started
            chunks = data.count(b"data: ")
        end = time.perf_counter() - started
        if close:
            self.close()
        return Sample(started, ttft if ttft is not None else end, end, status, chunks)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def closed_loop(
    url: str,
    body: dict | Callable[[], dict],
    *,
    concurrency: int,
    duration_s: float | None = None,
    requests: int | None = None,
    api_key: str | None = None,
    keep_alive: bool = True,
    pause_after_refusal_s: float = 0.0,
) -> RunResult:
    """``concurrency`` workers, each sending the next request when the last one ends.

    With ``keep_alive=False`` each worker closes its connection right after the response ends
    (after ``[DONE]``), as many SDK users with a client per request do. A worker refused with
    a 429 waits ``pause_after_refusal_s`` before its next request. ``body`` may be a callable
    that makes each request's body (a workload mix).
    """
    parts = urlsplit(url)
    fixed = None if callable(body) else orjson.dumps(body)
    headers = {"content-type": "application/json"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    result = RunResult()
    deadline = time.perf_counter() + duration_s if duration_s else None
    remaining = requests if requests is not None else None

    async def worker() -> None:
        nonlocal remaining
        conn = Connection(parts.hostname or "127.0.0.1", parts.port or 80)
        try:
            while True:
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                if remaining is not None:
                    if remaining <= 0:
                        return
                    remaining -= 1
                try:
                    payload = fixed if fixed is not None else orjson.dumps(body())
                    sample = await conn.request("POST", parts.path, headers, payload)
                    result.samples.append(sample)
                    if not keep_alive:
                        conn.close()
                    if sample.status == 429 and pause_after_refusal_s:
                        await asyncio.sleep(pause_after_refusal_s)
                except (OSError, ConnectionError, asyncio.IncompleteReadError, ValueError):
                    result.errors += 1
                    conn.close()
                    await asyncio.sleep(0.05)
        finally:
            conn.close()

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - began
    return result


def main() -> None:
    """``python -m loadtest.http_load URL --concurrency 16 --duration 10 [--api-key K]``: one
    closed-loop run of streaming chat (16 tokens) against a Forge started by
    ``python -m loadtest.serve_forge``; prints the summary as JSON."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("url", help="e.g. http://127.0.0.1:30000/v1/chat/completions")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--api-key", default="sk-bench-local-only")  # serve_forge's bench key
    parser.add_argument("--model", default="forge-sim")
    args = parser.parse_args()
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 16,
        "stream": True,
    }
    result = asyncio.run(
        closed_loop(
            args.url,
            body,
            concurrency=args.concurrency,
            duration_s=args.duration,
            api_key=args.api_key,
        )
    )
    print(json.dumps(result.summary()))


if __name__ == "__main__":
    main()
