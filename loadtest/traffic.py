"""Open-loop, multi-tenant traffic over real HTTP: what the demo and the eval gate drive.

Closed-loop clients (``http_load.py``) send less when the gateway slows down, which hides
overload; here every stream's arrivals are a seeded Poisson process that never waits for
answers, so a flood stays a flood and the latency measured under it is the latency a tenant
meets. Each request records what the gateway said about it (status, ``x-forge-backend``,
``x-forge-cache``, ``x-request-id``) and whether its stream ended honestly.

    results = asyncio.run(run("http://127.0.0.1:8000", [Stream("alpha", key, rate=8, ...)], 60))
    print(summarize(results, "alpha"))
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import httpx
import orjson

from loadtest.http_load import _pct
from serve_app.tokenizer import OUTPUT_WORDS

CHAT_PATH = "/v1/chat/completions"
DROPPED = "dropped"  # Result.error of an arrival the client did not send (max_in_flight)


@dataclass(frozen=True)
class Stream:
    """One class of traffic: a tenant's key, an arrival rate, request shapes, a time window."""

    name: str
    key: str
    rate: float  # requests per second, open loop, Poisson arrivals (seeded)
    prompt_tokens: int
    max_tokens: int
    model: str | None = None  # None: the first model of GET /v1/models
    stream: bool = True
    start_s: float = 0.0
    end_s: float | None = None  # None: until the run ends
    # Arrivals beyond it are recorded as dropped (client-side) and not sent: a bound on the
    # client's own memory and sockets when the gateway stops answering.
    max_in_flight: int = 256
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Result:
    stream: str
    start: float  # seconds since the run began
    status: int  # 0: transport error or timeout before the response's headers
    backend: str | None  # x-forge-backend
    cache: str | None  # x-forge-cache
    request_id: str | None  # x-request-id
    ttft: float | None
    total: float
    prompt_tokens: int | None
    completion_tokens: int | None
    # 200, but no [DONE], an SSE error event, or no finish_reason: what a client sees as broken.
    truncated: bool
    # None when ok; http_<code>, transport, timeout, error_event, no_done, no_finish_reason,
    # bad_json, or dropped (never sent; see Stream.max_in_flight).
    error: str | None

    def tpot(self) -> float | None:
        """Seconds per output token after the first (needs two tokens to mean anything)."""
        if self.ttft is None or self.completion_tokens is None or self.completion_tokens < 2:
            return None
        return (self.total - self.ttft) / (self.completion_tokens - 1)


def _blank(stream: str, start: float, error: str | None = None) -> Result:
    return Result(stream, start, 0, None, None, None, None, 0.0, None, None, False, error)


def prompt_of(tokens: int, salt: str = "") -> str:
    """About ``tokens`` tokens of Forge's tokenizer (exactly, for tokens >= 1), distinct per salt
    from the first token on, so neither the response cache nor a prefix cache sees repeats."""
    if tokens <= 0:
        return ""
    head = "s" + hashlib.blake2b(salt.encode(), digest_size=6).hexdigest()  # one \w+ token
    rng = random.Random(salt)
    words = rng.choices(OUTPUT_WORDS, k=tokens - 1)  # each " word" is one token
    return head + "".join(words)


def _percentile(values: list[float], p: float) -> float | None:
    return _pct(values, p) if values else None  # None, not NaN: the summary is JSON


def summarize(results: Iterable[Result], stream: str | None = None) -> dict:
    """One stream's (or every stream's) counts, ratios and latency percentiles.

    ``ok`` counts HTTP 200s (truncated ones included), ``errors`` every other sent request,
    ``failed`` both kinds a client notices (errors + truncated); dropped arrivals were never
    sent and count in none of them. Latencies are over complete 200s only.
    """
    chosen = [r for r in results if stream is None or r.stream == stream]
    sent = [r for r in chosen if r.error != DROPPED]
    ok = [r for r in sent if r.status == 200]
    complete = [r for r in ok if not r.truncated]
    truncated = len(ok) - len(complete)
    errors = len(sent) - len(ok)
    ttft = sorted(r.ttft for r in complete if r.ttft is not None)
    tpot = sorted(t for r in complete if (t := r.tpot()) is not None)
    total = sorted(r.total for r in complete)
    starts = [r.start for r in sent]
    span = max(starts) - min(starts) if starts else 0.0
    return {
        "requests": len(sent),
        "ok": len(ok),
        "errors": errors,
        "error_ratio": errors / len(sent) if sent else 0.0,
        "truncated": truncated,
        "truncation_ratio": truncated / len(ok) if ok else 0.0,
        "failed": errors + truncated,
        "dropped": len(chosen) - len(sent),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p95_s": _percentile(ttft, 95),
        "tpot_p50_s": _percentile(tpot, 50),
        "tpot_p95_s": _percentile(tpot, 95),
        "total_p50_s": _percentile(total, 50),
        "total_p95_s": _percentile(total, 95),
        "by_backend": dict(Counter(r.backend or "none" for r in sent)),
        "by_status": dict(sorted(Counter(r.status for r in sent).items())),
        "by_error": dict(Counter(r.error for r in sent if r.error)),
        "req_per_s": len(sent) / span if span > 0 else float(len(sent)),
    }


def write_jsonl(results: Iterable[Result], path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        for r in results:
            out.write(orjson.dumps(asdict(r)) + b"\n")


_FIELDS = {f.name for f in fields(Result)}


def read_jsonl(path: Path) -> list[Result]:
    rows = (orjson.loads(line) for line in Path(path).read_bytes().splitlines() if line.strip())
    return [Result(**{k: v for k, v in row.items() if k in _FIELDS}) for row in rows]


def _has_content(frame: dict) -> bool:
    for choice in frame.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("tool_calls") or choice.get("text"):
            return True
    return False


def _finish_reason(frame: dict) -> str | None:
    for choice in frame.get("choices") or ():
        if choice.get("finish_reason"):
            return choice["finish_reason"]
    return None


def _take_usage(frame: dict, result: Result) -> None:
    usage = frame.get("usage")
    if isinstance(usage, dict):
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")


async def _read_sse(response: httpx.Response, result: Result, t0: float) -> None:
    """Frames are small JSON objects; orjson parses one in about a microsecond, far below what
    httpx spends per chunk, so parsing each is the cheap *and* exact way."""
    done = finished = errored = False
    buffer = b""
    async for chunk in response.aiter_raw():
        buffer += chunk
        if b"\n" not in chunk:
            continue
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            try:
                frame = orjson.loads(data)
            except orjson.JSONDecodeError:
                errored = True
                continue
            if not isinstance(frame, dict):
                continue
            if "error" in frame:
                errored = True
                continue
            if result.ttft is None and _has_content(frame):
                result.ttft = time.perf_counter() - t0
            if not finished and _finish_reason(frame):
                finished = True
            if frame.get("usage"):
                _take_usage(frame, result)
    if errored:
        result.truncated, result.error = True, "error_event"
    elif not done:
        result.truncated, result.error = True, "no_done"
    elif not finished:
        result.truncated, result.error = True, "no_finish_reason"


async def _read_json(response: httpx.Response, result: Result, t0: float) -> None:
    body = b""
    async for chunk in response.aiter_raw():
        if result.ttft is None:
            result.ttft = time.perf_counter() - t0
        body += chunk
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        result.truncated, result.error = True, "bad_json"
        return
    if not isinstance(payload, dict) or "error" in payload:
        result.truncated, result.error = True, "error_event"
        return
    _take_usage(payload, result)
    if not _finish_reason(payload):
        result.truncated, result.error = True, "no_finish_reason"


async def _send(
    http: httpx.AsyncClient,
    stream: Stream,
    model: str,
    prompt: str,
    began: float,
    timeout_s: float,
) -> Result:
    body: dict = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": stream.max_tokens,
        "stream": stream.stream,
    }
    if stream.stream:
        body["stream_options"] = {"include_usage": True}
    headers = {
        "authorization": f"Bearer {stream.key}",
        "content-type": "application/json",
        **stream.headers,
    }
    t0 = time.perf_counter()
    result = _blank(stream.name, t0 - began)
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream(
                "POST", CHAT_PATH, content=orjson.dumps(body), headers=headers
            ) as response:
                result.status = response.status_code
                result.backend = response.headers.get("x-forge-backend")
                result.cache = response.headers.get("x-forge-cache")
                result.request_id = response.headers.get("x-request-id")
                if response.status_code != 200:
                    await response.aread()
                    result.error = f"http_{response.status_code}"
                elif "text/event-stream" in response.headers.get("content-type", ""):
                    await _read_sse(response, result, t0)
                else:
                    await _read_json(response, result, t0)
    except (TimeoutError, httpx.TimeoutException):
        result.error = "timeout"
    except (httpx.HTTPError, OSError):
        result.error = "transport"
    if result.error in ("timeout", "transport") and result.status == 200:
        result.truncated = True  # the headers said 200; the body never finished
    result.total = time.perf_counter() - t0
    return result


async def _first_models(http: httpx.AsyncClient, streams: Sequence[Stream]) -> dict[str, str]:
    """The first model GET /v1/models lists, per key that needs one (asked once per key)."""
    models: dict[str, str] = {}
    for s in streams:
        if s.model is not None or s.key in models:
            continue
        response = await http.get("/v1/models", headers={"authorization": f"Bearer {s.key}"})
        if response.status_code != 200:
            raise RuntimeError(
                f"GET /v1/models with stream {s.name!r}'s key: HTTP {response.status_code}"
            )
        data = response.json().get("data") or []
        if not data:
            raise RuntimeError(f"GET /v1/models lists no model for stream {s.name!r}")
        models[s.key] = data[0]["id"]
    return models


class _Progress:
    """A one-line status on stderr, redrawn in place: a long run should not look hung."""

    def __init__(self, duration_s: float) -> None:
        self.duration_s = duration_s
        self.sent = self.done = self.errors = self.dropped = 0
        self.backends: Counter[str] = Counter()

    def add(self, r: Result) -> None:
        if r.error == DROPPED:
            self.dropped += 1
            return
        self.done += 1
        if r.error:
            self.errors += 1
        self.backends[r.backend or "none"] += 1

    def line(self, elapsed: float) -> str:
        backends = " ".join(f"{k} {v}" for k, v in sorted(self.backends.items()))
        return (
            f"\r[{elapsed:6.1f}/{self.duration_s:.0f}s] sent {self.sent} done {self.done} "
            f"errors {self.errors} dropped {self.dropped} | {backends}\x1b[K"
        )


async def run(
    base_url: str,
    streams: Sequence[Stream],
    duration_s: float,
    *,
    seed: int = 0,
    timeout_s: float = 120.0,
    progress: bool = False,
    on_result: Callable[[Result], None] | None = None,
) -> list[Result]:
    """Send every stream's arrivals until ``duration_s``, then wait for the requests in flight
    (each bounded by ``timeout_s``). Results are in order of start."""
    streams = list(streams)
    if len({s.name for s in streams}) != len(streams):
        raise ValueError("stream names must be unique")
    for s in streams:
        if s.rate < 0 or s.max_in_flight < 1:
            raise ValueError(f"stream {s.name!r}: rate must be >= 0 and max_in_flight >= 1")
    results: list[Result] = []
    status = _Progress(duration_s)
    in_flight: Counter[str] = Counter()
    tasks: set[asyncio.Task] = set()
    connections = max(1, min(1024, sum(s.max_in_flight for s in streams)))
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0))

    def record(r: Result) -> None:
        results.append(r)
        status.add(r)
        if on_result is not None:
            on_result(r)

    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"), timeout=timeout, limits=limits, trust_env=False
    ) as http:
        models = await _first_models(http, streams)
        began = time.perf_counter()

        async def one(stream: Stream, model: str, prompt: str) -> None:
            in_flight[stream.name] += 1
            try:
                record(await _send(http, stream, model, prompt, began, timeout_s))
            finally:
                in_flight[stream.name] -= 1

        async def arrivals(index: int, stream: Stream) -> None:
            if stream.rate == 0:
                return
            rng = random.Random(f"{seed}:{index}:{stream.name}")
            end = duration_s if stream.end_s is None else min(stream.end_s, duration_s)
            model = stream.model or models[stream.key]
            t, n = stream.start_s, 0
            while True:
                t += rng.expovariate(stream.rate)
                if t >= end:
                    return
                if (delay := began + t - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
                n += 1
                if in_flight[stream.name] >= stream.max_in_flight:
                    now = time.perf_counter() - began
                    record(_blank(stream.name, now, DROPPED))
                    continue
                prompt = prompt_of(stream.prompt_tokens, f"{seed}:{stream.name}:{n}")
                task = asyncio.create_task(one(stream, model, prompt))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                status.sent += 1

        async def draw() -> None:
            while True:
                sys.stderr.write(status.line(time.perf_counter() - began))
                sys.stderr.flush()
                await asyncio.sleep(0.25)

        drawer = asyncio.create_task(draw()) if progress else None
        try:
            await asyncio.gather(*(arrivals(i, s) for i, s in enumerate(streams)))
            if tasks:  # each request ends by its own timeout; this is only a backstop
                await asyncio.wait(set(tasks), timeout=timeout_s + 5)
        finally:
            leftover = list(tasks)  # only when cancelled, or past the backstop
            for task in leftover:
                task.cancel()
            await asyncio.gather(*leftover, return_exceptions=True)
            if drawer is not None:
                drawer.cancel()
                await asyncio.gather(drawer, return_exceptions=True)
                sys.stderr.write(status.line(time.perf_counter() - began) + "\n")
                sys.stderr.flush()
    results.sort(key=lambda r: r.start)
    return results
