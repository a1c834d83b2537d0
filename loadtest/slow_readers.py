"""Slow readers (issue 31): what clients reading a byte a second cost the gateway and replicas.

    python -m loadtest.slow_readers --out loadtest/results/slow-readers.json   # 200 of them, ~3 min
    python -m loadtest.slow_readers --quick --out /tmp/slow-readers.json       # 20, ~1 min (CI)

It starts ``serve run`` of a copy of configs/local.yaml (``loadtest.local_graph``) changed only
so that all the slow streams fit at once and generate in seconds: the primary pool's admission,
its replicas' ``max_ongoing_requests``, ``max_num_seqs`` and KV blocks, a faster decode step
(``SLOW_ENGINE``), and the demo tenants' limits. Then, one phase after another:

1. **baseline**: ``--fast`` closed-loop clients (alpha's key; streamed, sampled, 16 tokens) for
   ``--phase-s``: their TTFT, and the RSS of the gateway replica, of each primary pool replica
   and of HAProxy, sampled every second (``psutil``, the processes found by their titles).
2. **filling**: ``--slow`` clients open (over ``--ramp-s``), each a raw socket (receive buffer
   ``--rcvbuf``) asking (beta's key) for a long stream (``--tokens``, ``ignore_eos``,
   ``temperature`` 0 with a prompt of its own: a cache miss whose answer the cache gathers while
   it passes), reading the response head and then one byte a second; ``--settle-s`` for every
   buffer on the way to fill and the engines to finish generating (their CPU back at idle says
   so).
3. **slow**: the fast clients again, beside the slow ones still reading.
4. **after**: the slow clients close; ``--after-s`` later, RSS once more.

HAProxy (``RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S``, 120 s in configs/local.yaml) cuts a client
whose window stays shut that long; the phases end before that, and the JSON says how many slow
clients were cut (``slow.closed_by_server``). Bytes kernel buffers hold are no process's RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import orjson
import psutil
import yaml

from loadtest import traffic
from loadtest.http_load import Connection, Sample
from loadtest.local_graph import (
    ALPHA_KEY,
    BETA_KEY,
    CONFIG,
    LOCAL_URL,
    REPO,
    port_answers,
    start_graph,
    stop_graph,
    wait_ready,
)

MODEL = "forge-sim-1b"
# The pool's engine for this run: configs/local.yaml's step (10 ms + 0.5 ms a sequence) would
# take minutes to generate 200 long streams at once on two replicas.
SLOW_ENGINE = {"decode_base_s": 0.005, "decode_per_seq_s": 0.00005}
# Process titles (Ray's ``ray::<actor class>``) of what is measured; several may match one.
PROCESSES = {
    "gateway": "ServeReplica:forge:gateway",
    "pool": "ServeReplica:forge-pool-primary:pool-primary",
    "haproxy": "haproxy",
}


def slow_config(slow: int, tokens: int) -> dict:
    """configs/local.yaml, with room for ``slow`` long streams at once (module docstring)."""
    config = yaml.safe_load((REPO / CONFIG).read_text())
    apps = {a["name"]: a for a in config["applications"]}
    gateway = apps["forge"]
    (primary,) = [p for p in gateway["args"]["pools"] if p["name"] == "primary"]
    # A tenant may hold max_tenant_share of the slots: room for all the slow ones and the fast.
    primary["admission"] = {**primary["admission"], "max_inflight": 2 * slow + 32, "queue_cap": 64}
    for deployment in gateway.get("deployments", []):
        for tenant in (deployment.get("user_config") or {}).get("tenants", []):
            tenant["limits"] = {
                "rpm": 100_000,
                "tpm": 1_000_000_000,
                "max_concurrent_streams": 4096,
            }
    pool = apps["forge-pool-primary"]["args"]["pool"]
    # Each replica can run every slow stream at once: the router may send most to one.
    per_replica = slow + 32
    blocks = per_replica * (tokens + 256) // pool["engine"].get("block_size", 16) + 1024
    engine = {**SLOW_ENGINE, "max_num_seqs": per_replica, "num_kv_blocks": blocks}
    pool["engine"] = {**pool["engine"], **engine}
    pool["deployment"] = {**pool["deployment"], "max_ongoing_requests": slow + 64}
    return config


# -- what the processes hold ----------------------------------------------------------------


def find_processes(session: int) -> dict[str, list[psutil.Process]]:
    """The measured processes of the graph ``serve run`` started in session ``session`` (other
    graphs on the machine, a test suite's, run deployments of the same names)."""
    found: dict[str, list[psutil.Process]] = {name: [] for name in PROCESSES}
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            title = " ".join(proc.info["cmdline"] or []) or proc.info["name"] or ""
            if os.getsid(proc.pid) != session:
                continue
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, PermissionError):
            continue
        for name, marker in PROCESSES.items():
            if marker in title and not title.startswith("ray::IDLE"):
                found[name].append(proc)
    return found


@dataclass
class RssSample:
    t: float  # seconds since the run began
    phase: str
    rss_mib: dict[str, float]  # per process: "gateway", "pool-0", "pool-1", "haproxy"
    cpu_pct: dict[str, float]
    machine_cpu_pct: float  # all cores (200 = both of two busy): others' work shows here


class RssWatch:
    def __init__(self, began: float, session: int) -> None:
        self.began = began
        self.phase = "baseline"
        self.samples: list[RssSample] = []
        self._procs = find_processes(session)
        psutil.cpu_percent(None)
        for procs in self._procs.values():
            for proc in procs:
                proc.cpu_percent(None)  # the first call starts its interval

    def describe(self) -> dict[str, list[int]]:
        return {name: [p.pid for p in procs] for name, procs in self._procs.items()}

    def sample(self) -> None:
        rss, cpu = {}, {}
        for name, procs in self._procs.items():
            for i, proc in enumerate(procs):
                label = name if len(procs) == 1 else f"{name}-{i}"
                try:
                    rss[label] = round(proc.memory_info().rss / 2**20, 1)
                    cpu[label] = proc.cpu_percent(None)
                except psutil.NoSuchProcess:
                    continue
        machine = psutil.cpu_percent(None) * psutil.cpu_count()
        t = time.perf_counter() - self.began
        self.samples.append(RssSample(t, self.phase, rss, cpu, round(machine, 1)))

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            await asyncio.sleep(1.0)

    def of(self, phase: str) -> list[RssSample]:
        return [s for s in self.samples if s.phase == phase]


# -- the clients ----------------------------------------------------------------------------


@dataclass
class SlowClient:
    status: int | None = None
    bytes_read: int = 0
    closed_by_server_at: float | None = None
    error: str | None = None


def _request(host: str, port: int, key: str, body: dict) -> bytes:
    payload = orjson.dumps(body)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}:{port}\r\n"
        f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


async def slow_reader(
    host: str, port: int, body: dict, rcvbuf: int, began: float, stop: asyncio.Event
) -> SlowClient:
    """One client: sends its request, reads the response head, then one byte a second (a raw
    socket, so nothing reads ahead of it: the kernel keeps at most ``rcvbuf``)."""
    loop = asyncio.get_running_loop()
    me = SlowClient()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await loop.sock_connect(sock, (host, port))
        await loop.sock_sendall(sock, _request(host, port, BETA_KEY, body))
        head = b""
        while not head.endswith(b"\r\n\r\n"):  # a few hundred bytes, at full speed
            part = await loop.sock_recv(sock, 1)
            if not part:
                raise ConnectionError("closed before the response head")
            head += part
        me.status = int(head.split()[1])
        while not stop.is_set():
            read = asyncio.ensure_future(loop.sock_recv(sock, 1))
            stopping = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({read, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done:
                read.cancel()
                break
            stopping.cancel()
            if not read.result():
                me.closed_by_server_at = time.perf_counter() - began
                break
            me.bytes_read += 1
            await asyncio.sleep(1.0)
    except OSError as exc:
        me.error = type(exc).__name__
    finally:
        sock.close()
    return me


async def fast_clients(url: str, clients: int, seconds: float) -> list[Sample]:
    parts = urlsplit(url)
    headers = {"content-type": "application/json", "authorization": f"Bearer {ALPHA_KEY}"}
    samples: list[Sample] = []
    deadline = time.perf_counter() + seconds

    async def one(i: int) -> None:
        conn = Connection(parts.hostname or "127.0.0.1", parts.port or 80)
        n = 0
        try:
            while time.perf_counter() < deadline:
                n += 1
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": traffic.prompt_of(32, f"f{i}:{n}")}],
                    "max_tokens": 16,
                    "temperature": 0.7,
                    "stream": True,
                }
                samples.append(
                    await conn.request("POST", "/v1/chat/completions", headers, orjson.dumps(body))
                )
        finally:
            conn.close()

    await asyncio.gather(*(one(i) for i in range(clients)))
    return samples


def ttft_summary(samples: list[Sample]) -> dict:
    ok = sorted(s.ttft for s in samples if s.status == 200)

    def pct(p: float) -> float | None:
        return round(ok[min(len(ok) - 1, int(p * len(ok)))] * 1000, 2) if ok else None

    return {
        "requests": len(samples),
        "ok": len(ok),
        "ttft_p50_ms": pct(0.5),
        "ttft_p90_ms": pct(0.9),
        "ttft_p99_ms": pct(0.99),
        "ttft_mean_ms": round(statistics.fmean(ok) * 1000, 2) if ok else None,
    }


# -- the run --------------------------------------------------------------------------------


@dataclass
class Settings:
    slow: int
    fast: int
    tokens: int
    phase_s: float
    settle_s: float
    rcvbuf: int
    ramp_s: float
    after_s: float


@dataclass
class Run:
    settings: Settings
    processes: dict = field(default_factory=dict)
    phases: dict = field(default_factory=dict)
    slow: dict = field(default_factory=dict)
    rss: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    samples: list = field(default_factory=list)


async def measure(url: str, settings: Settings, session: int) -> Run:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    run = Run(settings)
    began = time.perf_counter()
    watch = RssWatch(began, session)
    run.processes = watch.describe()
    stop_watch = asyncio.Event()
    watching = asyncio.create_task(watch.run(stop_watch))
    await fast_clients(url, settings.fast, 3.0)  # warm: the pool's first requests
    run.phases["baseline"] = ttft_summary(await fast_clients(url, settings.fast, settings.phase_s))

    watch.phase = "filling"
    stop_slow = asyncio.Event()
    tag = uuid.uuid4().hex[:8]

    async def opened(i: int) -> SlowClient:
        await asyncio.sleep(settings.ramp_s * i / max(settings.slow, 1))
        return await slow_reader(
            host,
            port,
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": traffic.prompt_of(32, f"slow:{tag}:{i}")}],
                "max_tokens": settings.tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            settings.rcvbuf,
            began,
            stop_slow,
        )

    readers = [asyncio.create_task(opened(i)) for i in range(settings.slow)]
    await asyncio.sleep(settings.ramp_s + settings.settle_s)

    watch.phase = "slow"
    run.phases["slow"] = ttft_summary(await fast_clients(url, settings.fast, settings.phase_s))

    watch.phase = "after"
    stop_slow.set()
    slow = await asyncio.gather(*readers)
    await asyncio.sleep(settings.after_s)
    stop_watch.set()
    await watching

    statuses: dict[str, int] = {}
    for client in slow:
        statuses[str(client.status)] = statuses.get(str(client.status), 0) + 1
    run.slow = {
        "clients": len(slow),
        "status": statuses,
        "bytes_read_mean": round(statistics.fmean(c.bytes_read for c in slow), 1),
        "closed_by_server": sum(1 for c in slow if c.closed_by_server_at is not None),
        "errors": sum(1 for c in slow if c.error),
    }
    run.rss = rss_table(watch, statuses.get("200", 0))
    run.samples = [asdict(s) for s in watch.samples]
    ours = sum(sum(s.cpu_pct.values()) for s in watch.samples)
    run.machine = {
        # The machine's CPU beside ours (the graph's measured processes): another job running.
        "cpu_pct_mean": round(statistics.fmean(s.machine_cpu_pct for s in watch.samples), 1),
        "cpu_pct_of_measured_processes_mean": round(ours / max(len(watch.samples), 1), 1),
        "load_avg_1m_at_end": round(psutil.getloadavg()[0], 2),
    }
    return run


def rss_table(watch: RssWatch, slow: int) -> dict:
    """Per process: RSS at the end of the baseline, the most while the slow clients read, at the
    end, and the growth per slow stream served (``slow``: those answered 200)."""
    table = {}
    labels = sorted({label for s in watch.samples for label in s.rss_mib})
    for label in labels:

        def values(phase: str, label: str = label) -> list[float]:
            return [s.rss_mib[label] for s in watch.of(phase) if label in s.rss_mib]

        base, filling, slow_phase, after = (
            values(p) for p in ("baseline", "filling", "slow", "after")
        )
        if not base:
            continue
        peak = max(filling + slow_phase, default=base[-1])
        table[label] = {
            "baseline_mib": base[-1],
            "peak_mib": peak,
            "after_mib": after[-1] if after else None,
            "growth_per_slow_stream_kib": round((peak - base[-1]) * 1024 / slow, 1) if slow else 0,
            "cpu_pct_end_of_filling": (
                [s.cpu_pct.get(label) for s in watch.of("filling")][-1]
                if watch.of("filling")
                else None
            ),
        }
    return table


def markdown(run: Run) -> str:
    s = run.settings
    lines = [
        f"{s.slow} slow clients (1 byte/s, {s.tokens}-token streams), {s.fast} fast clients",
        "",
        "| process | RSS baseline MiB | RSS peak MiB | after MiB | growth per slow stream KiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, row in run.rss.items():
        lines.append(
            f"| {label} | {row['baseline_mib']} | {row['peak_mib']} | {row['after_mib']} | "
            f"{row['growth_per_slow_stream_kib']} |"
        )
    lines += [
        "",
        "| fast clients | requests | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for phase, row in run.phases.items():
        lines.append(
            f"| {phase} | {row['ok']} | {row['ttft_p50_ms']} | {row['ttft_p90_ms']} | "
            f"{row['ttft_p99_ms']} |"
        )
    lines.append("")
    lines.append(f"slow clients: {run.slow}")
    lines.append(f"machine: {run.machine}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=200, help="slow clients")
    parser.add_argument("--fast", type=int, default=4, help="fast closed-loop clients")
    parser.add_argument("--tokens", type=int, default=2000, help="each slow stream's length")
    parser.add_argument("--phase-s", type=float, default=30.0, help="fast clients per phase")
    parser.add_argument("--ramp-s", type=float, default=5.0, help="slow clients open over this")
    parser.add_argument("--settle-s", type=float, default=60.0, help="after the last one opened")
    parser.add_argument("--after-s", type=float, default=15.0, help="after they close")
    parser.add_argument("--rcvbuf", type=int, default=4096, help="slow clients' SO_RCVBUF")
    parser.add_argument("--quick", action="store_true", help="20 slow clients, short phases")
    parser.add_argument("--out", default="loadtest/results/slow-readers.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.slow, args.tokens, args.phase_s, args.settle_s, args.after_s = 20, 1000, 5, 15, 5
    settings = Settings(
        args.slow,
        args.fast,
        args.tokens,
        args.phase_s,
        args.settle_s,
        args.rcvbuf,
        args.ramp_s,
        args.after_s,
    )
    if port_answers(LOCAL_URL):
        print(f"{LOCAL_URL} already answers: stop that gateway first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="forge-slow-readers-") as tmp:
        workdir = Path(tmp)
        config = workdir / "slow-readers.yaml"
        config.write_text(yaml.safe_dump(slow_config(args.slow, args.tokens), sort_keys=False))
        log = workdir / "serve-run.log"
        proc = start_graph(log, config)
        try:
            wait_ready(LOCAL_URL, proc, log, 300)
            url = LOCAL_URL + "/v1/chat/completions"
            run = asyncio.run(measure(url, settings, session=proc.pid))
        finally:
            stop_graph(proc, drain=False)
    result = {
        **asdict(run),
        "host": {
            "platform": platform.platform(),
            "cpus": psutil.cpu_count(),
            "python": platform.python_version(),
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(markdown(run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
