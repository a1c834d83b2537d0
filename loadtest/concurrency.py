"""Concurrency (issue 36, item 1): how many long-lived streams one gateway replica on one core
holds before it adds inter-token latency, and what each open stream costs it; LiteLLM beside it.

    python -m loadtest.concurrency                 # 100 → 5,000 streams; direct, Forge, LiteLLM
    python -m loadtest.concurrency --quick --targets direct forge --out /tmp/c.json   # CI

**The load.** N streams held open at once (N stepped 100 → 500 → 1,000 → 2,000 → 5,000), each a
slow generation (``--rate``, 5 tokens/s by default) long enough to outlast its step. The streams
open at ``--open-per-s`` (a stream's start costs the gateway its whole request pipeline; opening
5,000 at once would measure admission, not holding), then ``--settle-s``, then the ``--window-s``
in which everything is measured; then the client closes them all (the gateway cancels upstream)
and the next step opens afresh on the same server.

**The engine's own schedule.** The engine is the simulator in its paced mode
(``SimulatedEngineConfig.paced_tokens_per_s``, ``serve_app/engines/paced.py``): each stream on
a timer of its own (streams opened over a ramp spread evenly over the period, as a fleet of
engines out of step would; the batched simulator would hand the gateway N frames at once every
step), and each token's text the engine's CLOCK_MONOTONIC when it sent it, the first one also
when the request reached the engine. The client reads the same clock as each frame arrives, so
for every token it knows the delay the path added (arrival − send): **added inter-token
latency** is the change in that delay from a stream's token to its next (its gap at the client
less its gap at the engine), **added TTFT** is the client's TTFT less the engine's own (first
token sent − request reached the engine): the request's way in plus the first token's way out.
Forge's engine runs in its pool replica (the path is client → HAProxy → gateway replica →
Serve handle → pool replica); LiteLLM's is the same engine behind ``serve_app.mock_openai``
(client → LiteLLM → HTTP → mock). The engine's own serving layer (the pool replica's handle
streaming, the mock's uvicorn) is on the path after the stamp: part of what is added, for both.
``direct`` (the client straight to the mock) is the floor: what the client and the mock's own
HTTP add on this machine.

**Pins.** The gateway alone on core 0: Forge's gateway replica (every thread of its process,
re-pinned after Serve starts it; the rest of the graph, HAProxy, Ray's daemons and the pool
replica included, on core 1) and LiteLLM's proxy process (its backend mock on core 1). The
client processes (``--client-procs``, raw asyncio sockets: a protocol callback per read, the
stamps found by one regex over the bytes) on core 1 too. Each row reports the gateway's CPU,
the engine's, the client's and each core's busy share, so a reader can tell which one ran out.

**What the benchmark raises, and why** (each would refuse or queue streams long before the
gateway's CPU is the limit):

- the gateway's ``max_ongoing_requests`` (1,024 in ``serve_app/app.py``): past it Serve queues
  new requests in front of the replica. Here the
  largest step plus 64 (``loadtest.serve_forge --max-streams``), as the pool replica's (by
  default twice ``max_num_seqs``) and the engine's ``max_num_seqs``;
- fair admission's ``max_inflight`` and ``queue_cap`` and the tenant's
  ``max_concurrent_streams``: one tenant holds every stream here;
- HAProxy's global ``maxconn`` (``RAY_SERVE_HAPROXY_MAXCONN``, 4,096 by default) to twice the
  largest step, as far as the open files allow (HAProxy asks for 2.5 a connection and will not
  start past the hard limit: 7,960 here); HAProxy's files (config, sockets, state) in a
  directory of this run's, not the shared /tmp/haproxy-serve;
- open files (``ulimit -n``): each process raises its soft limit to the hard one (here 20,000;
  a stream holds a socket in the client, two in HAProxy and one in the gateway);
- the client has no pool to raise: a socket per stream, opened on schedule.

**Where the delay grows** (``--hops DIR``): Forge notes each stamped frame's delay at each hop
of a fed stream's path (``serve_app/hop_delays.py``: into the replica's feed, out of it, off the
feed at the gateway, taken by the gateway's server), and each row gets every hop's p50 / p99
over its window beside the client's.

**The knee**: the first N where added inter-token latency p99 is over 5 ms, or any stream
failed (refused, cut, or no first token by the window's end). Results:
``loadtest/results/concurrency.json`` and ``concurrency.png``; docs/benchmarks.md
"Concurrency". The machine is shared: each step records the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import orjson

from loadtest import litellm_proxy, overhead
from loadtest.serve_forge import BENCH_KEY
from serve_app import hop_delays
from serve_app.engines.paced import STAMP

STEPS = [100, 500, 1000, 2000, 5000]
QUICK_STEPS = [20, 50]
KNEE_ITL_P99_MS = 5.0
GATEWAY_CORE, OTHER_CORE = 0, 1
MODEL = "forge-sim"
TARGETS = ("direct", "forge", "litellm")
COLORS = {"direct": "tab:gray", "forge": "tab:blue", "litellm": "tab:orange"}


# --- the arithmetic (pure: tests/loadtest/test_concurrency.py) ---------------------------------


class Tally:
    """One client process's readings for one step: per token in the window, the delay the path
    added and its change from the stream's previous token; per stream, its added TTFT; and
    why streams failed."""

    def __init__(self, window: tuple[float, float]) -> None:
        self.window = window
        self.added_itl = array("d")  # seconds
        self.delay = array("d")
        self.ttft = array("d")
        self.added_ttft = array("d")
        self.errors: Counter[str] = Counter()
        self.tokens = 0

    def first_token(self, sent: float, reached: float, emitted: float, arrival: float) -> None:
        """A stream's first token: the client's TTFT less the engine's own."""
        self.ttft.append(arrival - sent)
        self.added_ttft.append((arrival - sent) - (emitted - reached))

    def as_dict(self) -> dict:
        return {
            "added_itl": self.added_itl.tobytes(),
            "delay": self.delay.tobytes(),
            "ttft": self.ttft.tobytes(),
            "added_ttft": self.added_ttft.tobytes(),
            "errors": dict(self.errors),
            "tokens": self.tokens,
        }


class StreamClock:
    """One stream's tokens as they arrive, against when the engine sent each."""

    __slots__ = ("last_delay", "reached", "sent", "started", "tally")

    def __init__(self, tally: Tally, sent: float) -> None:
        self.tally = tally
        self.sent = sent  # when the client sent the request
        self.reached: float | None = None  # when the engine got it
        self.last_delay: float | None = None
        self.started = False

    def arrived(self, emitted: float, arrival: float) -> None:
        tally = self.tally
        delay = arrival - emitted
        if not self.started:
            self.started = True
            tally.first_token(self.sent, self.reached or emitted, emitted, arrival)
        start, end = tally.window
        if start <= arrival < end:
            tally.tokens += 1
            tally.delay.append(delay)
            if self.last_delay is not None:
                tally.added_itl.append(delay - self.last_delay)
        self.last_delay = delay


def percentile(values: list[float] | array, p: float) -> float:
    """Nearest rank (``values`` sorted); NaN for none."""
    if not len(values):
        return float("nan")
    return values[min(len(values) - 1, max(0, math.ceil(p / 100 * len(values)) - 1))]


def knee(rows: list[dict], itl_p99_ms: float = KNEE_ITL_P99_MS) -> int | None:
    """The first number of streams (rows in step order) where added ITL p99 is over the bound
    or any stream failed; None if no step reached it."""
    for row in sorted(rows, key=lambda r: r["streams"]):
        itl = row["added_itl_p99_ms"]
        if row["errors"] > 0 or (itl == itl and itl > itl_p99_ms):  # NaN: no tokens, errors say
            return row["streams"]
    return None


def rss_per_stream_kib(rss_mib: float, idle_mib: float, streams: int, errors: int) -> float:
    """The gateway's growth over its idle RSS per stream it held: a failed stream (refused,
    never answered) is not counted as held."""
    return round((rss_mib - idle_mib) * 1024 / max(1, streams - errors), 2)


def merge(parts: list[dict]) -> dict:
    """The client processes' tallies of one step, as latency percentiles in ms."""
    out: dict = {"errors": 0, "error_kinds": Counter(), "tokens": 0}
    for name in ("added_itl", "delay", "ttft", "added_ttft"):
        values = array("d")
        for part in parts:
            values.frombytes(part[name])
        ordered = sorted(values)
        for p in (50, 99):
            out[f"{name}_p{p}_ms"] = round(percentile(ordered, p) * 1000, 3)
    for part in parts:
        out["error_kinds"].update(part["errors"])
        out["tokens"] += part["tokens"]
    out["errors"] = sum(out["error_kinds"].values())
    out["error_kinds"] = dict(out["error_kinds"])
    return out


# --- the client ----------------------------------------------------------------------------


class StreamProtocol(asyncio.Protocol):
    """One stream on a raw socket: the status line, then every stamp in every read."""

    def __init__(self, request: bytes, tally: Tally) -> None:
        self.request = request
        self.tally = tally
        self.clock: StreamClock | None = None
        self.transport: asyncio.Transport | None = None
        self.buffer = b""
        self.status: int | None = None
        self.done = False  # [DONE] came, or it failed
        self.closing = False  # the client is closing it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.clock = StreamClock(self.tally, time.monotonic())
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buffer = self.buffer + data
        if self.status is None:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                self.buffer = buffer
                return
            self.status = int(buffer[9:12])
            if self.status != 200:
                self._fail(f"http {self.status}")
                return
            buffer = buffer[end + 4 :]
        cut = buffer.rfind(b"\n") + 1
        self.buffer = buffer[cut:]
        ready = buffer[:cut]
        clock = self.clock
        assert clock is not None
        for marker, seconds in STAMP.findall(ready):
            if marker == b"@":
                clock.reached = float(seconds)
            else:
                clock.arrived(float(seconds), now)
        if b"[DONE]" in ready:
            self._fail("ended before the window did")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closing and not self.done:
            self._fail("closed by the server" if exc is None else type(exc).__name__)

    def _fail(self, why: str) -> None:
        if not self.done:
            self.done = True
            self.tally.errors[why] += 1
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        self.closing = True
        if not self.done and (self.clock is None or not self.clock.started):
            self.done = True
            self.tally.errors["no first token"] += 1
        if self.transport is not None:
            self.transport.close()


def _request_bytes(url: str, key: str, tokens: int) -> bytes:
    parts = urlsplit(url)
    body = orjson.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell a long story about gateways."}],
            "max_tokens": tokens,
            "temperature": 1.0,  # never cached: every stream reaches the engine
            "stream": True,
        }
    )
    head = (
        f"POST {parts.path} HTTP/1.1\r\nhost: {parts.hostname}:{parts.port}\r\n"
        f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _raise_open_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _client(plan: dict) -> dict:
    loop = asyncio.get_running_loop()
    start, end = plan["window"]
    tally = Tally((start, end))
    parts = urlsplit(plan["url"])
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    streams: list[StreamProtocol] = []
    cpu: dict[str, float] = {}
    loop.call_at(start, lambda: cpu.__setitem__("start", _cpu_s()))
    loop.call_at(end, lambda: cpu.__setitem__("end", _cpu_s()))

    async def connect(stream: StreamProtocol) -> None:
        try:
            await loop.create_connection(lambda: stream, host, port)
        except OSError as exc:
            stream.done = True
            tally.errors[f"connect: {type(exc).__name__}"] += 1

    connecting = set()
    for at in plan["open_at"]:
        await asyncio.sleep(max(0.0, at - loop.time()))
        stream = StreamProtocol(plan["request"], tally)
        streams.append(stream)
        task = asyncio.create_task(connect(stream))
        connecting.add(task)
        task.add_done_callback(connecting.discard)
    await asyncio.sleep(max(0.0, end - loop.time()) + 0.05)
    for task in list(connecting):
        task.cancel()
    for stream in streams:
        stream.close()
    await asyncio.sleep(0.2)  # let the transports close
    window_cpu = cpu.get("end", math.nan) - cpu.get("start", math.nan)
    return {**tally.as_dict(), "cpu_s": window_cpu}


def _client_process(conn, plan: dict) -> None:
    os.sched_setaffinity(0, plan["cpus"])
    _raise_open_files()
    # The event loop's clock is time.monotonic (CLOCK_MONOTONIC): the engine's stamps' clock.
    result = asyncio.run(_client(plan))
    conn.send(result)
    conn.close()


# --- what the server processes hold --------------------------------------------------------


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (a thread started later inherits its starter's pin)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), cpus)


def _alive(pid: int) -> bool:
    """Running: not gone, and no zombie (LiteLLM's proxy is our child until it is reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _cpu_of(pids: list[int]) -> float:
    _, cpu = overhead._proc_table()
    return sum(cpu.get(pid, 0.0) for pid in pids)


def _rss_mib(pid: int) -> float:
    kib = overhead._kib(f"/proc/{pid}/status", "VmRSS:")
    return (kib or 0) / 1024


def _core_times() -> list[tuple[int, int]]:
    """Per core: (busy, total) jiffies from /proc/stat."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            values = [int(v) for v in line.split()[1:]]
            idle = values[3] + values[4]
            out.append((sum(values) - idle, sum(values)))
    return out


def _busy_pct(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[float]:
    return [
        round(100 * (b1 - b0) / max(1, t1 - t0), 1)
        for (b0, t0), (b1, t1) in zip(before, after, strict=True)
    ]


@dataclass
class Target:
    """A started server graph: where to send streams, which process is the gateway."""

    name: str
    url: str
    server: overhead.Server | overhead.ServerGroup
    gateway: int | None  # pid; None for direct
    workdir: Path
    idle_rss_mib: float = 0.0
    idle_cpu: float = 0.0  # the gateway's CPU at rest (Ray's polls, metrics), in cores

    def pids_by_role(self) -> dict[str, list[int]]:
        children, _ = overhead._proc_table()
        roles: dict[str, list[int]] = {}
        for pid in overhead._graph_pids(self.server.pids(), children):
            roles.setdefault(overhead._role(pid), []).append(pid)
        if self.gateway is not None:
            roles["gateway"] = [self.gateway]
        return roles


@dataclass
class Settings:
    steps: list[int]
    rate: float
    open_per_s: float
    settle_s: float
    window_s: float
    client_procs: int
    via: str
    litellm_venv: Path = field(default=litellm_proxy.DEFAULT_VENV)
    profile_dir: Path | None = None  # py-spy's record of the gateway in each window, if set
    py_spy: str = "py-spy"
    hops_dir: Path | None = None  # Forge's delay at each hop (serve_app/hop_delays.py), if set

    def tokens(self, streams: int) -> int:
        """Each stream's length: past its step's window by a few seconds."""
        ramp = streams / self.open_per_s
        return math.ceil(self.rate * (ramp + self.settle_s + self.window_s + 5))

    def engine(self) -> dict:
        room = max(self.steps) + 64
        return {
            "paced_tokens_per_s": self.rate,
            "max_num_seqs": room,
            "max_num_batched_tokens": room,
            "max_model_len": self.tokens(max(self.steps)) + 256,
        }


def haproxy_maxconn(streams: int) -> int:
    """Room for every stream twice over, within the open files this process may have: HAProxy
    asks for 2.5 a connection of ``maxconn`` (and refuses to start beyond the hard limit)."""
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return min(2 * streams + 1024, int((files - 100) / 2.5))


def _haproxy_env(settings: Settings, workdir: Path) -> dict[str, str]:
    files = workdir / "hx"  # Ray adds a 40-character directory; HAProxy's socket paths ≤ 97
    files.mkdir(parents=True, exist_ok=True)
    return {
        **overhead._haproxy_env(),
        "RAY_SERVE_HAPROXY_MAXCONN": str(haproxy_maxconn(max(settings.steps))),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(files / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(files / "admin.sock"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(files),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(files / "server-state"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(files / "metrics.sock"),
    }


def _start_mock(settings: Settings) -> tuple[overhead.Server, int]:
    port = overhead._free_port()
    mock = overhead.Server(
        overhead._mock_argv(port, json.dumps(settings.engine())), cpus=str(OTHER_CORE)
    )
    try:
        overhead._wait_ready(f"http://127.0.0.1:{port}/v1/models", proc=mock.proc)
    except BaseException:
        mock.stop()
        raise
    return mock, port


def start_target(name: str, settings: Settings) -> Target:
    workdir = Path(tempfile.mkdtemp(prefix=f"fc-{name}-", dir="/tmp"))
    if name == "direct":
        mock, port = _start_mock(settings)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        return Target(name, url, mock, None, workdir)
    if name == "forge":
        argv = ["-m", "loadtest.serve_forge", "--port", str(overhead._free_port())]
        argv += ["--engine", json.dumps(settings.engine()), "--max-streams"]
        argv += [str(max(settings.steps))]
        env = (  # direct ingress either way (the gateway replica's own port)
            _haproxy_env(settings, workdir)
            if settings.via == "haproxy"
            else {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
        )
        if settings.hops_dir is not None:
            shutil.rmtree(settings.hops_dir, ignore_errors=True)
            settings.hops_dir.mkdir(parents=True)
            env["FORGE_HOP_DELAYS"] = str(settings.hops_dir)
        server = overhead.Server(argv, env=env, cpus=str(OTHER_CORE))
        try:
            proxy, direct_ingress = server.read_ready()
            base = proxy if settings.via == "haproxy" else direct_ingress
            target = Target(name, f"{base}/v1/chat/completions", server, None, workdir)
            (gateway,) = [p for p in target.pids_by_role().get("gateway", [])]
        except BaseException:
            server.stop()
            raise
        target.gateway = gateway
        return target
    venv = litellm_proxy.ensure_venv(settings.litellm_venv)
    mock, backend_port = _start_mock(settings)
    port = overhead._free_port()
    config = litellm_proxy.write_config(workdir, backend_port, MODEL, BENCH_KEY)
    try:
        proxy = overhead.Server(
            litellm_proxy.proxy_argv(venv, config, port),
            env=litellm_proxy.proxy_env(),
            python=False,
            inherit_env=False,
            log=workdir / "litellm.log",
            cpus=str(GATEWAY_CORE),
        )
    except BaseException:
        mock.stop()
        raise
    group = overhead.ServerGroup(mock, proxy)
    try:
        url = f"http://127.0.0.1:{port}"
        overhead._wait_ready(f"{url}/health/liveliness", timeout=300, proc=proxy.proc)
    except BaseException:
        group.stop()
        raise
    return Target(name, f"{url}/v1/chat/completions", group, proxy.proc.pid, workdir)


# --- one step ------------------------------------------------------------------------------


def run_step(target: Target, streams: int, settings: Settings) -> dict:
    load_before = os.getloadavg()
    if target.gateway is not None:
        _pin(target.gateway, {GATEWAY_CORE})
    roles = target.pids_by_role()
    request = _request_bytes(target.url, BENCH_KEY, settings.tokens(streams))
    began = time.monotonic() + 1.0  # the client processes start meanwhile
    opens = [began + i / settings.open_per_s for i in range(streams)]
    window_start = opens[-1] + settings.settle_s
    window = (window_start, window_start + settings.window_s)
    procs = max(1, min(settings.client_procs, streams // 50 or 1))
    ctx = multiprocessing.get_context("fork")
    clients = []
    for i in range(procs):
        receive, send = ctx.Pipe(duplex=False)
        plan = {
            "url": target.url,
            "request": request,
            "open_at": opens[i::procs],
            "window": window,
            "cpus": {OTHER_CORE},
        }
        proc = ctx.Process(target=_client_process, args=(send, plan), daemon=True)
        proc.start()
        clients.append((proc, receive))
    time.sleep(max(0.0, window[0] - time.monotonic()))
    watched = {role: roles.get(role, []) for role in ("gateway", "engine", "proxy")}
    cpu0 = {role: _cpu_of(pids) for role, pids in watched.items()}
    cores0 = _core_times()
    spy, profile = None, None
    if settings.profile_dir is not None and target.gateway is not None:
        settings.profile_dir.mkdir(parents=True, exist_ok=True)
        profile = settings.profile_dir / f"{target.name}-{streams}.txt"
        record = ["record", "--pid", str(target.gateway), "--format", "raw", "--nonblocking"]
        record += ["--duration", str(int(settings.window_s)), "--rate", "100"]
        spy = subprocess.Popen(
            [settings.py_spy, *record, "--output", str(profile)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    rss: list[float] = []
    while time.monotonic() < window[1]:
        if target.gateway is not None and (mib := _rss_mib(target.gateway)) > 0:  # 0: it died
            rss.append(mib)
        time.sleep(min(1.0, max(0.0, window[1] - time.monotonic())))
    cpu1 = {role: _cpu_of(pids) for role, pids in watched.items()}
    cores = _busy_pct(cores0, _core_times())
    if spy is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.wait(30)
    parts = []
    for proc, receive in clients:
        if receive.poll(settings.window_s + 60):
            parts.append(receive.recv())
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    row = {"target": target.name, "streams": streams, **merge(parts)}
    if len(parts) < len(clients):
        row["errors"] += 1
        row["error_kinds"]["a client process gave no result"] = len(clients) - len(parts)
    seconds = settings.window_s
    cpu = {role: (cpu1[role] - cpu0[role]) / seconds for role in watched}
    client_cpu = sum(p["cpu_s"] for p in parts) / seconds
    gateway_rss = sum(rss) / len(rss) if rss else math.nan
    busy = max(0.0, cpu["gateway"] - target.idle_cpu)  # what the streams cost it
    row |= {
        "tokens_per_s": round(row["tokens"] / seconds, 1),
        "gateway_cpu_pct": round(100 * cpu["gateway"], 1),
        "gateway_cpu_us_per_token": round(1e6 * busy * seconds / row["tokens"], 1)
        if row["tokens"]
        else math.nan,
        "gateway_cpu_ms_per_stream_s": round(1000 * busy / streams, 3),
        "gateway_rss_mib": round(gateway_rss, 1),
        "gateway_rss_kib_per_stream": rss_per_stream_kib(
            gateway_rss, target.idle_rss_mib, streams, row["errors"]
        ),
        "engine_cpu_pct": round(100 * cpu["engine"], 1),
        "proxy_cpu_pct": round(100 * cpu["proxy"], 1),  # HAProxy (Forge via :8000's path)
        "client_cpu_pct": round(100 * client_cpu, 1),
        "core_busy_pct": cores,
        "load_avg_before": [round(v, 2) for v in load_before],
    }
    time.sleep(3.0)  # the closed streams' cancellations, before the next step's baseline
    row["load_avg_after"] = [round(v, 2) for v in os.getloadavg()]
    if profile is not None and profile.exists():
        row["profile"] = {"file": str(profile), **profile_shares(profile.read_text())}
    if settings.hops_dir is not None and target.name == "forge":
        row["hops"] = hop_table(hop_delays.read(settings.hops_dir, *window), row)
        print(json.dumps({"streams": streams, "hops": row["hops"]}), flush=True)
    print(json.dumps(_brief(row)), flush=True)
    return row


def hop_table(delays: dict[str, list[float]], row: dict) -> dict[str, dict]:
    """Each hop's delay p50 / p99 (ms) over the window, in the path's order, the client's last:
    where along the way a frame's delay grew."""
    hops = {}
    for hop in hop_delays.HOPS:
        if values := sorted(delays.get(hop, ())):
            hops[hop] = {
                "p50_ms": round(1000 * percentile(values, 50), 2),
                "p99_ms": round(1000 * percentile(values, 99), 2),
                "frames": len(values),
            }
    hops["client"] = {"p50_ms": row.get("delay_p50_ms"), "p99_ms": row.get("delay_p99_ms")}
    return hops


def _brief(row: dict) -> dict:
    keys = (
        "target",
        "streams",
        "errors",
        "added_itl_p50_ms",
        "added_itl_p99_ms",
        "delay_p99_ms",
        "added_ttft_p50_ms",
        "gateway_cpu_pct",
        "gateway_rss_kib_per_stream",
        "engine_cpu_pct",
        "client_cpu_pct",
        "core_busy_pct",
    )
    return {k: row[k] for k in keys if k in row}


def warm(target: Target, settings: Settings) -> None:
    """A few streams through (connections, Serve's routers, imports), then the idle RSS."""
    quick = Settings([10], settings.rate, 50, 0.5, 1.0, 1, settings.via)
    run_step(target, 10, quick)
    time.sleep(2.0)
    if target.gateway is not None:
        target.idle_rss_mib = _rss_mib(target.gateway)
        before = _cpu_of([target.gateway])
        time.sleep(3.0)
        target.idle_cpu = (_cpu_of([target.gateway]) - before) / 3.0


def run_target(name: str, settings: Settings) -> dict:
    load_before = os.getloadavg()
    target = start_target(name, settings)
    try:
        warm(target, settings)
        rows = [run_step(target, n, settings) for n in settings.steps]
    finally:
        died = target.gateway is not None and not _alive(target.gateway)
        target.server.stop()
        if died:  # LiteLLM's log is in it
            print(f"{name}: the gateway process died; kept {target.workdir}", file=sys.stderr)
        else:
            shutil.rmtree(target.workdir, ignore_errors=True)
    return {
        "target": name,
        "idle_gateway_rss_mib": round(target.idle_rss_mib, 1),
        "idle_gateway_cpu_pct": round(100 * target.idle_cpu, 1),
        "knee": knee(rows),
        "rows": rows,
        "load_avg_before": [round(v, 2) for v in load_before],
        "load_avg_after": [round(v, 2) for v in os.getloadavg()],
    }


def _part(frame: str) -> str | None:
    """What a py-spy frame (``function (path:line)``) belongs to: a Forge module, a module of
    Serve's machinery, or a library the request path runs through."""
    where = frame.rpartition(" (")[2]
    if "serve_app/" in where:
        return "serve_app/" + where.split("serve_app/", 1)[1].split(":")[0]
    if "ray/serve/" in where:
        return "ray.serve: " + where.rsplit("/", 1)[1].split(":")[0]
    path = "/" + where  # py-spy names site-packages' files from the package down
    for name in ("grpc", "uvicorn", "h11", "starlette", "opentelemetry", "prometheus_client"):
        if f"/{name}/" in path or f"/{name}." in path:
            return name
    if "/ray/" in path:
        return "ray (other)"
    if "/asyncio/" in path:
        return "asyncio"
    return None


def profile_shares(raw: str, top: int = 20, part_of=None) -> dict:
    """py-spy's raw (collapsed) stacks as shares of the samples: per part, the samples with a
    frame of it anywhere (inclusive), and the samples whose innermost known part it is (self).
    ``part_of`` names a frame's part (``_part`` unless given)."""
    part_of = part_of or _part
    inclusive: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        parts = [p for p in (part_of(f) for f in stack.split(";")) if p]
        for part in set(parts):
            inclusive[part] += n
        leaf[parts[-1] if parts else "other"] += n
        if not any(p.startswith("serve_app/") for p in parts):
            inclusive["(no Forge frame)"] += n

    def shares(counts: Counter[str]) -> dict[str, float]:
        return {k: round(100 * v / max(total, 1), 1) for k, v in counts.most_common(top)}

    return {"samples": total, "inclusive_pct": shares(inclusive), "self_pct": shares(leaf)}


# --- report --------------------------------------------------------------------------------


def table(data: dict) -> str:
    lines = [
        "| target | streams | errors | added ITL p50 / p99 ms | token delay p50 / p99 ms | "
        "added TTFT p50 / p99 ms | tokens/s | gateway CPU % | µs/token | ms/stream·s | "
        "gateway RSS MiB | KiB/stream | engine CPU % | client CPU % | cores busy % | load 1m |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for result in data["results"]:
        for r in result["rows"]:
            lines.append(
                f"| {r['target']} | {r['streams']:,} | {r['errors']} | "
                f"{r['added_itl_p50_ms']:.2f} / {r['added_itl_p99_ms']:.2f} | "
                f"{r['delay_p50_ms']:.2f} / {r['delay_p99_ms']:.2f} | "
                f"{r['added_ttft_p50_ms']:.2f} / {r['added_ttft_p99_ms']:.2f} | "
                f"{r['tokens_per_s']:,.0f} | {r['gateway_cpu_pct']} | "
                f"{r['gateway_cpu_us_per_token']} | {r['gateway_cpu_ms_per_stream_s']} | "
                f"{r['gateway_rss_mib']} | "
                f"{r['gateway_rss_kib_per_stream']} | {r['engine_cpu_pct']} | "
                f"{r['client_cpu_pct']} | {' / '.join(str(c) for c in r['core_busy_pct'])} | "
                f"{r['load_avg_before'][0]} → {r['load_avg_after'][0]} |"
            )
    lines.append("")
    for result in data["results"]:
        k = result["knee"]
        if "error" in result:
            lines.append(f"- {result['target']}: did not run: {result['error']}")
            continue
        lines.append(
            f"- {result['target']}: knee "
            + (f"at {k:,} streams" if k else "not reached")
            + f" (added ITL p99 > {KNEE_ITL_P99_MS:g} ms or errors > 0)"
        )
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    from loadtest.plots import save, subplots

    fig, (itl, rss) = subplots(1, 2, figsize=(10, 4))

    def points(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
        kept = [(r["streams"], r[key]) for r in rows if r[key] == r[key] and r[key] > 0]
        return [x for x, _ in kept], [y for _, y in kept]

    for result in data["results"]:
        style = {"marker": "o", "label": result["target"], "color": COLORS.get(result["target"])}
        itl.plot(*points(result["rows"], "added_itl_p99_ms"), **style)
        if result["target"] != "direct":
            rss.plot(*points(result["rows"], "gateway_rss_kib_per_stream"), **style)
    itl.set(xlabel="open streams", ylabel="added ITL p99 (ms)")
    rss.set(xlabel="open streams", ylabel="gateway RSS per open stream (KiB)")
    for axis, scales in ((itl, ("x", "y")), (rss, ("x",))):
        if any(len(line.get_xdata()) for line in axis.get_lines()):  # all failed: nothing
            for which in scales:
                getattr(axis, f"set_{which}scale")("log")
    itl.axhline(KNEE_ITL_P99_MS, color="grey", linestyle="--", linewidth=1)
    for axis in (itl, rss):
        axis.legend()
        axis.grid(True, alpha=0.3)
    save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} streams, short")
    parser.add_argument("--steps", nargs="+", type=int, default=STEPS)
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    parser.add_argument("--rate", type=float, default=5.0, help="tokens/s of each stream")
    parser.add_argument("--open-per-s", type=float, default=100.0, help="streams opened a second")
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=20.0, help="measured, per step")
    parser.add_argument("--client-procs", type=int, default=2)
    parser.add_argument(
        "--via",
        choices=["haproxy", "direct-ingress"],
        default="haproxy",
        help="Forge's way in: HAProxy as configs/local.yaml's :8000, or the replica's own port",
    )
    parser.add_argument("--litellm-venv", type=Path, default=litellm_proxy.DEFAULT_VENV)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="record the gateway with py-spy (--nonblocking, 100 Hz) in each window, into this "
        "directory; the rows then carry its shares (py-spy costs the machine a little CPU)",
    )
    parser.add_argument("--py-spy", default="py-spy", help="py-spy's executable")
    parser.add_argument(
        "--hops",
        type=Path,
        default=None,
        help="Forge notes each stamped frame's delay at each hop of its path into this "
        "directory (serve_app/hop_delays.py); the rows then carry each hop's p50 / p99",
    )
    parser.add_argument("--out", default="loadtest/results/concurrency.json")
    parser.add_argument("--png", default=None, help="the plot (default: beside --out)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.window_s, args.settle_s, args.rate = QUICK_STEPS, 4.0, 1.0, 10.0
    settings = Settings(
        args.steps,
        args.rate,
        args.open_per_s,
        args.settle_s,
        args.window_s,
        args.client_procs,
        args.via,
        args.litellm_venv,
        args.profile,
        args.py_spy,
        args.hops,
    )
    _raise_open_files()  # the servers inherit it
    os.sched_setaffinity(0, {OTHER_CORE})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data: dict = {
        "meta": {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared",
            "python": platform.python_version(),
            "command": " ".join(["python -m loadtest.concurrency", *(argv or sys.argv[1:])]),
            "litellm": litellm_proxy.installed_version(args.litellm_venv)
            if "litellm" in args.targets
            else None,
            "settings": {
                k: v for k, v in vars(settings).items() if k not in ("litellm_venv", "py_spy")
            },
            "open_files": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            "haproxy_maxconn": haproxy_maxconn(max(settings.steps)),
        },
        "results": [],
    }
    failed = False
    for name in args.targets:
        try:
            data["results"].append(run_target(name, settings))
        except Exception as exc:  # the others still run; the JSON says why this one did not
            failed = True
            print(f"{name}: {exc!r}", file=sys.stderr, flush=True)
            data["results"].append({"target": name, "error": repr(exc), "knee": None, "rows": []})
        out.write_text(json.dumps(data, indent=1, default=str))  # after each: a long run
    png = Path(args.png) if args.png else out.with_suffix(".png")
    plot(data, png)
    print(table(data))
    print(f"wrote {out} and {png}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
