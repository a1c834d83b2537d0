"""Soak: mixed multi-tenant traffic for a long while, faults on a schedule, memory watched.

    python -m loadtest.soak --minutes 30 --out loadtest/results/soak

Starts its own graph in this process (Ray with a small object store, Serve's proxy, the mock
fallback as ``soak-mock`` and Forge as ``forge-soak`` on ``/soak``, the store a private
redis-server that this soak restarts), then for ``--minutes``:

- **traffic**, open loop, from a child process (it keeps every result, so its memory grows by
  design and is kept apart from the processes judged): four tenants, one with a concurrent-stream
  cap and one rate-limited; chat streamed and not, completions, embeddings (a ``task: embed``
  pool), temperature-0 repeats (cache hits) and streams the client abandons after a few frames;
- **faults**, one every ``--fault-every`` minutes, in turn: the primary pool's replicas answer
  500 for 30 s (``POST /admin/faults``; the fallback serves), the youngest primary replica is
  killed (``ray.kill``; Serve replaces it), Redis is stopped for 10 s and started again (its
  append-only file keeps the data: usage written before the restart must still be there);
- **memory**: the RSS of every process of this Ray instance and of the soak (by command line:
  each Serve replica as ``<app>:<deployment>``, proxy, controller, GCS, raylet, dashboard and its
  agents, Redis, the driver, the load generator), every ``--sample-every`` seconds.

Then it checks, and exits 1 if any check fails:

- **memory**: per role, the RSS of the processes alive over the whole measured window (the
  last two thirds of the run; the first third is warm-up) grew by at most ``--bound`` percent
  (median of the first and of the last minute of the window). Replacements born later (a
  killed replica's) are shown but not judged; the load generator and Redis are shown only;
- **admission**: every pool's scheduler has nothing in flight, nothing queued and no slot used
  (parked slots go back after ``keep_warm_s`` idle); every pool replica runs, queues and
  streams nothing;
- **stream leases**: the capped tenant holds no live lease in Redis (a release lost while Redis
  was down expires by its TTL: waited for, and said), and its next request sees the whole cap;
- **metering**: the usage report counts every request sent, and its prompt and completion tokens
  equal the engines' own counters (every primary and embed replica, a killed replica's as read
  just before the kill, and the mock fallback's), within the part no backend could say: requests
  charged the gateway's estimate (``estimated_requests``) and requests in flight on a replica
  when it was killed, each at most its prompt plus its ``max_tokens``.

Writes ``<out>.json`` (config, faults, checks, per-role table, traffic summary), ``<out>.csv``
(every RSS sample), ``<out>.png`` (RSS per role over time) and ``<out>.md`` (the tables).
``tests/e2e/test_soak.py`` runs the same ``soak()`` for 3 minutes inside the e2e session's Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import datetime as dt
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx
import orjson

from loadtest import inprocess, traffic
from loadtest.processes import role_of
from loadtest.traffic import DROPPED, Result, Stream

APP = "forge-soak"
PREFIX = "/soak"
MOCK_APP = "soak-mock"
MOCK_PREFIX = "/soak-mock"
MODEL = "forge-soak"
EMBED_MODEL = "forge-soak-embed"
PRIMARY = "primary"
KEY_PREFIX = "forge-soak:"
ADMIN_KEY = "sk-soak-admin-local-only"

T = TypeVar("T")


def tenant_key(tenant: str) -> str:
    return f"sk-soak-{tenant}-local-only"


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# -- the graph -------------------------------------------------------------------------------

CAPPED_STREAMS = 3
TENANTS: dict[str, dict] = {
    "interactive": {"weight": 2},
    "capped": {"limits": {"max_concurrent_streams": CAPPED_STREAMS}},
    "limited": {"limits": {"rpm": 30, "tpm": 6000}},
    "batch": {"tier": "batch", "limits": {"rpm": 6000, "tpm": 10_000_000}},
}
# A GPU's feel, scaled to two cores: ~10 ms a decode step, ~20 ms a prefill.
ENGINE = {
    "max_num_seqs": 8,
    "prefill_base_s": 0.02,
    "prefill_per_token_s": 0.0001,
    "decode_base_s": 0.01,
    "decode_per_seq_s": 0.0005,
}


def soak_args(fallback_url: str, redis_url: str | None, ledger_path: str | None = None) -> dict:
    """Forge's args for the soak: two gateway replicas sharing Redis, a primary pool of two
    replicas behind fair admission and the mock fallback, an embedding pool. Its usage ledger
    is a SQLite file of its own (a new one per soak unless ``ledger_path`` names one): the
    metering checks compare the ledger with this soak's traffic, so the laptop's default file,
    which keeps every earlier run's usage, would fail them from the second run on."""
    no_cpu = {"ray_actor_options": {"num_cpus": 0}}
    if ledger_path is None:
        ledger_path = str(Path(tempfile.mkdtemp(prefix="forge-soak-ledger-")) / "usage.sqlite3")
    return {
        "gateway": {"deployment": {"num_replicas": 2 if redis_url else 1, **no_cpu}},
        "store": {"redis_url": redis_url, "key_prefix": KEY_PREFIX},
        "metering": {"sqlite_path": ledger_path},
        "admin": {"key_hashes": [_sha(ADMIN_KEY)]},
        "faults": {"enabled": True},  # the primary's error window is POST /admin/faults
        "tenants": [
            {"name": name, "key_hashes": [_sha(tenant_key(name))], **extra}
            for name, extra in TENANTS.items()
        ],
        "pools": [
            {
                "name": PRIMARY,
                "model": MODEL,
                "engine": ENGINE,
                "connect_timeout_s": 10.0,
                "first_token_timeout_s": 10.0,
                "request_timeout_s": 60.0,
                "routing": {"policy": "least_in_flight"},
                "admission": {
                    "max_inflight": 16,
                    "queue_cap": 8,
                    "deadline_s": 10,
                    "max_tenant_share": 0.75,
                },
                "deployment": {"num_replicas": 2, "max_ongoing_requests": 32, **no_cpu},
            },
            {
                "name": "embed",
                "model": EMBED_MODEL,
                "task": "embed",
                "engine": {"max_num_seqs": 32, "prefill_base_s": 0.005, "embedding_dim": 128},
                "deployment": {"num_replicas": 1, **no_cpu},
            },
        ],
        "resilience": {"breaker": {"cooldown_s": 5.0}},
        "fallback": {
            "base_url": fallback_url,
            "model": "mock-gemini",
            "kinds": ["chat", "completion"],  # the mock serves both
        },
    }


class PersistentRedis:
    """A private redis-server whose data outlives a restart: an append-only file in a directory
    of its own (synced every second, Redis's default, and on the SIGTERM that stops it; syncing
    every write stalled it past the gateway's 50 ms store timeout on two busy cores). The soak
    stops and starts it; what the usage ledger wrote before must still be there afterwards (the
    machine's own Redis is shared: not that one)."""

    def __init__(self) -> None:
        self.port = inprocess.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = Path(tempfile.mkdtemp(prefix="forge-soak-redis-"))
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--dir",
                str(self.dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if self.client().ping():
                    return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in 20 s")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()  # SIGTERM: Redis syncs its append-only file and exits
            self.proc.wait(20)
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def live_leases(self, key: str) -> int:
        """Leases under ``key`` that have not expired (scores are expiry, server ms)."""
        r = self.client()
        seconds, micros = r.time()
        return int(r.zcount(key, seconds * 1000 + micros // 1000 + 1, "+inf"))


@dataclass
class Graph:
    """A deployed soak graph: where to send traffic, and the Redis it uses (None: embedded)."""

    proxy_url: str
    redis: PersistentRedis | None

    @property
    def url(self) -> str:
        return self.proxy_url + PREFIX


def start_ray(*, dashboard: bool = True) -> str:
    """Ray for the CLI (the dashboard on, as ``serve run`` has it, unless ``dashboard`` is
    False: a drill that judges no memory spares two cores its processes) and Serve's proxy;
    its URL."""
    import ray
    from ray import serve

    ray.init(
        num_cpus=2,
        object_store_memory=100 * 1024 * 1024,
        include_dashboard=dashboard,
        dashboard_port=inprocess.free_port() if dashboard else None,
        log_to_driver=False,
    )
    port = inprocess.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def deploy(
    proxy_url: str,
    redis: PersistentRedis | None,
    make_args: Callable[[str, str | None], dict] = soak_args,
) -> Graph:
    """The mock fallback and Forge as two more Serve applications in the running Ray (the
    CLI's own, or the e2e session's), once every backend is ready. ``make_args(fallback URL,
    Redis URL)``: Forge's args (the soak's; ``loadtest/books.py`` adds tenants to them)."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.mock_openai import build_mock

    mock_engine = {**ENGINE, "max_num_seqs": 64}
    serve.run(
        build_mock({"model": "mock-gemini", "engine": mock_engine}),
        name=MOCK_APP,
        route_prefix=MOCK_PREFIX,
    )
    args = make_args(f"{proxy_url}{MOCK_PREFIX}/v1", redis.url if redis else None)
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    graph = Graph(proxy_url, redis)
    inprocess.wait_ready(graph.url, inprocess.every_backend, timeout_s=180)
    return graph


def undeploy() -> None:
    from ray import serve

    for app in (APP, MOCK_APP):
        with contextlib.suppress(Exception):
            serve.delete(app, _blocking=False)


# -- traffic ---------------------------------------------------------------------------------


def chat_streams() -> list[Stream]:
    """The chat traffic (``traffic.run``): 6.3 requests/s over three tenants."""

    def key(t: str) -> str:
        return tenant_key(t)

    return [
        Stream("chat-stream", key("interactive"), 2.5, 96, 48, MODEL, max_in_flight=64),
        Stream("chat-json", key("interactive"), 1.0, 64, 32, MODEL, stream=False, max_in_flight=64),
        # ~0.6 s streams at 2/s: now and then a fourth at once, refused by the cap of 3.
        Stream("capped", key("capped"), 2.0, 64, 96, MODEL, max_in_flight=64),
        # 48 a minute against rpm 30: once its burst is spent, ~2 in 5 are refused.
        Stream("limited", key("limited"), 0.8, 64, 64, MODEL, max_in_flight=64),
    ]


@dataclass(frozen=True)
class Extra:
    """Traffic ``traffic.run`` does not send: another route, or a client that leaves early."""

    name: str
    tenant: str
    kind: str  # completion, embedding, abandon, cached
    rate: float
    max_tokens: int = 32
    prompt_tokens: int = 64


EXTRAS = (
    Extra("completion", "batch", "completion", 0.5),
    Extra("embedding", "batch", "embedding", 0.5, max_tokens=0, prompt_tokens=32),
    # Leaves after 5 frames of a 256-token generation: the replica must abort and free the slot.
    Extra("abandon", "interactive", "abandon", 0.2, max_tokens=256),
    # 16 prompts at temperature 0, over and over: cache hits after the first of each.
    Extra("cached", "interactive", "cached", 0.4, max_tokens=16, prompt_tokens=32),
)
CACHED_PROMPTS = 16
ABANDON_AFTER_FRAMES = 5
EMBED_INPUTS = 4
# Chat templates add a few tokens to a prompt (serve_app.tokenizer); a bound, not a count.
TEMPLATE_SLACK = 16


def max_charge() -> tuple[int, int]:
    """The most prompt and completion tokens one soak request can be charged: what an estimate
    or a killed replica's request can be off by, at most."""
    prompts = [s.prompt_tokens for s in chat_streams()] + [
        e.prompt_tokens * (EMBED_INPUTS if e.kind == "embedding" else 1) for e in EXTRAS
    ]
    outputs = [s.max_tokens for s in chat_streams()] + [e.max_tokens for e in EXTRAS]
    return max(prompts) + TEMPLATE_SLACK, max(outputs)


def _extra_request(extra: Extra, n: int, seed: int) -> tuple[str, dict]:
    salt = f"{seed}:{extra.name}:{n}"
    if extra.kind == "embedding":
        inputs = [
            traffic.prompt_of(extra.prompt_tokens, f"{salt}:{i}") for i in range(EMBED_INPUTS)
        ]
        return "/v1/embeddings", {"model": EMBED_MODEL, "input": inputs}
    if extra.kind == "completion":
        body = {
            "model": MODEL,
            "prompt": traffic.prompt_of(extra.prompt_tokens, salt),
            "max_tokens": extra.max_tokens,
            "stream": n % 2 == 0,
        }
        return "/v1/completions", body
    if extra.kind == "cached":
        content = traffic.prompt_of(extra.prompt_tokens, f"{seed}:cached:{n % CACHED_PROMPTS}")
        body = {"temperature": 0, "stream": n % 2 == 0}
    else:  # abandon
        content = traffic.prompt_of(extra.prompt_tokens, salt)
        body = {"stream": True, "ignore_eos": True}
    messages = [{"role": "user", "content": content}]
    return traffic.CHAT_PATH, {
        "model": MODEL,
        "messages": messages,
        "max_tokens": extra.max_tokens,
        **body,
    }


async def _send_extra(
    http: httpx.AsyncClient, extra: Extra, n: int, seed: int, began: float, timeout_s: float
) -> Result:
    path, body = _extra_request(extra, n, seed)
    headers = {"authorization": f"Bearer {tenant_key(extra.tenant)}"}
    t0 = time.perf_counter()
    result = traffic._blank(extra.name, t0 - began)
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", path, content=orjson.dumps(body), headers=headers) as r:
                result.status = r.status_code
                result.backend = r.headers.get("x-forge-backend")
                result.cache = r.headers.get("x-forge-cache")
                result.request_id = r.headers.get("x-request-id")
                if r.status_code != 200:
                    await r.aread()
                    result.error = f"http_{r.status_code}"
                elif extra.kind == "abandon":
                    frames = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            frames += 1
                            if frames == 1:
                                result.ttft = time.perf_counter() - t0
                            if frames >= ABANDON_AFTER_FRAMES:
                                break  # leaving: the connection closes with the block
                elif extra.kind == "embedding":
                    payload = orjson.loads(await r.aread())
                    result.ttft = time.perf_counter() - t0
                    if len(payload.get("data") or ()) != EMBED_INPUTS:
                        result.truncated, result.error = True, "bad_json"
                    usage = payload.get("usage") or {}
                    result.prompt_tokens = usage.get("prompt_tokens")
                elif "text/event-stream" in r.headers.get("content-type", ""):
                    await traffic._read_sse(r, result, t0)
                else:
                    await traffic._read_json(r, result, t0)
    except (TimeoutError, httpx.TimeoutException):
        result.error = "timeout"
    except (httpx.HTTPError, OSError, orjson.JSONDecodeError):
        result.error = "transport"
    if result.error in ("timeout", "transport") and result.status == 200:
        result.truncated = True
    result.total = time.perf_counter() - t0
    return result


async def run_extras(
    base_url: str,
    extras: Sequence[Extra],
    duration_s: float,
    *,
    seed: int = 0,
    timeout_s: float = 60.0,
    max_in_flight: int = 64,
    send: Callable[..., Awaitable[Result]] | None = None,
) -> list[Result]:
    """``traffic.run``'s open loop (seeded Poisson arrivals, never waiting for answers) for the
    extras; arrivals beyond ``max_in_flight`` of one kind are recorded as dropped. ``send``:
    what sends one (``_send_extra``'s arguments; ``loadtest/books.py`` adds a kind)."""
    send = send or _send_extra
    results: list[Result] = []
    tasks: set[asyncio.Task] = set()
    in_flight: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout_s, limits=limits, trust_env=False
    ) as http:
        began = time.perf_counter()

        async def one(extra: Extra, n: int) -> None:
            in_flight[extra.name] += 1
            try:
                results.append(await send(http, extra, n, seed, began, timeout_s))
            finally:
                in_flight[extra.name] -= 1

        async def arrivals(extra: Extra) -> None:
            rng = random.Random(f"{seed}:extra:{extra.name}")
            t, n = 0.0, 0
            while True:
                t += rng.expovariate(extra.rate)
                if t >= duration_s:
                    return
                if (delay := began + t - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)
                n += 1
                if in_flight[extra.name] >= max_in_flight:
                    results.append(traffic._blank(extra.name, t, DROPPED))
                    continue
                task = asyncio.create_task(one(extra, n))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        await asyncio.gather(*(arrivals(e) for e in extras if e.rate > 0))
        if tasks:
            await asyncio.wait(set(tasks), timeout=timeout_s + 5)
    return results


async def _all_traffic(url: str, duration_s: float, seed: int) -> list[Result]:
    chat, extras = await asyncio.gather(
        traffic.run(url, chat_streams(), duration_s, seed=seed, timeout_s=60.0),
        run_extras(url, EXTRAS, duration_s, seed=seed),
    )
    return sorted(chat + extras, key=lambda r: r.start)


def _load_generator(url: str, duration_s: float, seed: int, out: str) -> None:
    """The child process's body: all the traffic, then every result to ``out`` (JSON lines)."""
    traffic.write_jsonl(asyncio.run(_all_traffic(url, duration_s, seed)), Path(out))


# -- memory ----------------------------------------------------------------------------------

# Shown, never judged: the load generator keeps every result by design; Redis is the store
# (its once-ids live an hour by design, see serve_app/store/base.py); idle workers come and go.
UNJUDGED = frozenset({"loadgen", "redis", "redis-soak", "idle-worker", "other"})
# Replicas judged: the soak's own apps (in the e2e session, its other apps are idle bystanders).
JUDGED_APPS = frozenset({APP, MOCK_APP})


def judged_role(role: str) -> bool:
    app, colon, _ = role.partition(":")
    return role not in UNJUDGED and (not colon or app in JUDGED_APPS)


@dataclass
class MemorySampler:
    """RSS of every process under ``root`` (this driver: Ray's GCS, raylet and dashboard are its
    children, every worker the raylet's), by role, one round per ``sample()``."""

    root: int
    roles: dict[int, str] = field(default_factory=dict)  # fixed roles by pid (driver, loadgen)
    rounds: list[tuple[float, dict[int, tuple[str, int]]]] = field(default_factory=list)
    began: float = field(default_factory=time.monotonic)
    # Every process seen: its role, command line (cut short), first and last round.
    processes: dict[int, dict] = field(default_factory=dict)

    def sample(self) -> dict[int, tuple[str, int]]:
        import psutil

        root = psutil.Process(self.root)
        now = round(time.monotonic() - self.began, 1)
        seen: dict[int, tuple[str, int]] = {}
        for proc in [root, *root.children(recursive=True)]:
            try:
                with proc.oneshot():
                    cmdline = proc.cmdline()
                    role = self.roles.get(proc.pid) or role_of(cmdline, proc.name())
                    seen[proc.pid] = (role, proc.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            known = self.processes.setdefault(
                proc.pid, {"role": role, "cmdline": " ".join(cmdline)[:160], "first_s": now}
            )
            known["role"], known["last_s"] = role, now
        self.rounds.append((now, seen))
        return seen

    def by_role(self) -> dict[str, list[tuple[float, int]]]:
        """Each role's summed RSS at each round (rounds where the role had no process: absent)."""
        out: dict[str, list[tuple[float, int]]] = {}
        for t, seen in self.rounds:
            totals: Counter[str] = Counter()
            for role, rss in seen.values():
                totals[role] += rss
            for role, rss in totals.items():
                out.setdefault(role, []).append((t, rss))
        return out


@dataclass
class RoleMemory:
    role: str
    processes_start: int
    processes_end: int
    survivors: int  # processes alive in both windows: what growth is measured on
    start_mb: float  # all the role's processes, at the warm-up's end (median of the window)
    end_mb: float  # all of them, at the end
    survivors_start_mb: float | None
    survivors_end_mb: float | None
    growth_pct: float | None  # the survivors'; None: no process lived through the window
    # The survivors' least-squares slope over the whole window: a slow climb under the bound
    # shows here (MB an hour), where two medians cannot tell it from noise.
    trend_mb_per_h: float | None
    judged: bool
    ok: bool


def role_memory(
    rounds: Sequence[tuple[float, dict[int, tuple[str, int]]]],
    start: tuple[float, float],
    end: tuple[float, float],
    bound_pct: float,
) -> list[RoleMemory]:
    """Per role: RSS at the start and end windows (medians over their rounds), and the growth
    of the processes alive in both (a replaced process would show up as a drop, its young
    successor's warm-up as a leak)."""
    first = [seen for t, seen in rounds if start[0] <= t <= start[1]]
    last = [seen for t, seen in rounds if end[0] <= t <= end[1]]
    judged_window = [(t, seen) for t, seen in rounds if start[0] <= t <= end[1]]
    if not first or not last:
        raise ValueError(f"no samples in the windows {start} and {end}")

    def pids(window: list[dict], role: str) -> set[int]:
        return {pid for seen in window for pid, (r, _) in seen.items() if r == role}

    def median_mb(window: list[dict], chosen: set[int]) -> float:
        sums = [sum(rss for pid, (_, rss) in seen.items() if pid in chosen) for seen in window]
        return statistics.median(sums) / 2**20

    roles = sorted({r for seen in first + last for r, _ in seen.values()})
    out = []
    for role in roles:
        before, after = pids(first, role), pids(last, role)
        # Alive at every round of both windows: one that died or was born inside them is out.
        both = {
            pid
            for pid in before & after
            if all(pid in seen for seen in first) and all(pid in seen for seen in last)
        }
        s_start = median_mb(first, both) if both else None
        s_end = median_mb(last, both) if both else None
        growth = (s_end / s_start - 1) * 100 if both and s_start else None
        trend = _slope_mb_per_h(judged_window, both) if both else None
        judged = judged_role(role) and growth is not None
        out.append(
            RoleMemory(
                role=role,
                processes_start=len(before),
                processes_end=len(after),
                survivors=len(both),
                start_mb=median_mb(first, before) if before else 0.0,
                end_mb=median_mb(last, after) if after else 0.0,
                survivors_start_mb=s_start,
                survivors_end_mb=s_end,
                growth_pct=growth,
                trend_mb_per_h=trend,
                judged=judged,
                ok=not judged or growth <= bound_pct,
            )
        )
    return out


def _slope_mb_per_h(rounds: Sequence[tuple[float, dict]], pids: set[int]) -> float | None:
    """Least-squares slope of these processes' summed RSS over the rounds that saw them all."""
    points = [
        (t, sum(rss for pid, (_, rss) in seen.items() if pid in pids) / 2**20)
        for t, seen in rounds
        if pids <= seen.keys()
    ]
    if len(points) < 3:
        return None
    slope = statistics.linear_regression([t for t, _ in points], [mb for _, mb in points]).slope
    return slope * 3600


# -- faults ----------------------------------------------------------------------------------

FAULT_KINDS = ("primary_errors", "replica_kill", "redis_restart")
PRIMARY_ERRORS_S = 30.0
REDIS_DOWN_S = 10.0


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: str
    lasts_s: float = 0.0


def fault_plan(duration_s: float, every_s: float, with_redis: bool) -> list[Fault]:
    """A fault every ``every_s`` seconds, the kinds in turn, each over by ``duration_s - 20``."""
    kinds = [k for k in FAULT_KINDS if with_redis or k != "redis_restart"]
    lasts = {"primary_errors": PRIMARY_ERRORS_S, "redis_restart": REDIS_DOWN_S}
    plan, at = [], every_s
    while True:
        kind = kinds[len(plan) % len(kinds)]
        if at + lasts.get(kind, 0.0) > duration_s - 20:
            return plan
        plan.append(Fault(at, kind, lasts.get(kind, 0.0)))
        at += every_s


@dataclass
class KilledReplica:
    at_s: float
    replica: str
    stats: dict  # its engine counters, read just before the kill


class FaultInjector:
    """Does what the plan says to the soak's graph, and keeps what metering needs of it."""

    def __init__(self, graph: Graph, admin: httpx.Client) -> None:
        self.graph = graph
        self.admin = admin
        self.killed: list[KilledReplica] = []
        self.log: list[dict] = []

    def start(self, fault: Fault, now_s: float) -> None:
        detail = getattr(self, f"_start_{fault.kind}")(now_s)
        self.log.append({"t_s": round(now_s, 1), "event": f"{fault.kind} start", **detail})

    def end(self, fault: Fault, now_s: float) -> None:
        detail = getattr(self, f"_end_{fault.kind}")()
        self.log.append({"t_s": round(now_s, 1), "event": f"{fault.kind} end", **detail})

    def _set_primary_fault(self, mode: str) -> dict:
        body = {"pool": PRIMARY, "fault": {"mode": mode}}
        answer = self.admin.post("/admin/faults", json=body)
        answer.raise_for_status()
        return {"replicas": len(answer.json()["replicas"])}

    def _start_primary_errors(self, now_s: float) -> dict:
        return self._set_primary_fault("error")

    def _end_primary_errors(self) -> dict:
        return self._set_primary_fault("none")

    def _start_replica_kill(self, now_s: float) -> dict:
        """Kill the youngest primary replica, so one replica lives through the whole run and
        its memory can be judged; Serve starts a replacement."""
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE

        from serve_app.replica import admin as replica_admin

        deployment = f"pool-{PRIMARY}"
        ids = replica_admin.replica_ids(APP, deployment)
        actors = {
            r: ray.get_actor(f"SERVE_REPLICA::{APP}#{deployment}#{r}", namespace=SERVE_NAMESPACE)
            for r in ids
        }
        pids = {
            r: ray.get(a.__ray_call__.remote(lambda _actor: os.getpid())) for r, a in actors.items()
        }
        victim = max(ids, key=lambda r: _create_time(pids[r]))
        stats = replica_admin.stats(APP, deployment, victim)
        ray.kill(actors[victim], no_restart=True)
        self.killed.append(KilledReplica(now_s, victim, stats))
        busy = stats["num_requests_running"] + stats["num_requests_waiting"]
        return {"replica": victim, "pid": pids[victim], "in_flight": busy}

    def _end_replica_kill(self) -> dict:
        return {}

    def _start_redis_restart(self, now_s: float) -> dict:
        assert self.graph.redis is not None
        self.graph.redis.stop()
        return {"port": self.graph.redis.port}

    def _end_redis_restart(self) -> dict:
        assert self.graph.redis is not None
        self.graph.redis.start()
        return {"pid": self.graph.redis.pid}


def _create_time(pid: int) -> float:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return 0.0


# -- object census ---------------------------------------------------------------------------

CENSUS_DEPLOYMENTS = (
    (APP, "gateway"),
    (APP, f"pool-{PRIMARY}"),
    (APP, "pool-embed"),
    (APP, f"scheduler-{PRIMARY}"),
    (APP, "breaker-board"),
    (MOCK_APP, "mock-openai"),
)


def object_census(deployments: Sequence[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """Live objects by type in every replica of these deployments: the garbage collector's
    tracked ones (instances, containers; not str or int), enough to name what a leak keeps."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    from serve_app.replica import admin as replica_admin

    # Defined in here so that it is pickled by value: a replica cannot import the loadtest.
    def count(_actor) -> dict[str, int]:
        import gc
        from collections import Counter

        return dict(
            Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
        )

    refs = {}
    for app, deployment in deployments:
        for rid in replica_admin.replica_ids(app, deployment):
            name = f"SERVE_REPLICA::{app}#{deployment}#{rid}"
            actor = ray.get_actor(name, namespace=SERVE_NAMESPACE)
            refs[f"{app}:{deployment}#{rid}"] = actor.__ray_call__.remote(count)
    return {key: ray.get(ref, timeout=120) for key, ref in refs.items()}


@dataclass
class Census:
    """Object counts per replica at the warm-up's end and near the end: which types grew."""

    at_s: tuple[float, ...]
    snapshots: list[tuple[float, dict[str, dict[str, int]]]] = field(default_factory=list)

    def take(self, now_s: float) -> None:
        try:
            self.snapshots.append((now_s, object_census(CENSUS_DEPLOYMENTS)))
        except Exception as exc:  # evidence, not a check: say it failed and go on
            self.snapshots.append((now_s, {"error": {repr(exc): 0}}))

    def growth(self, top: int = 8) -> dict[str, list[dict]]:
        """Per replica present in the first and last census: the types that grew most."""
        if len(self.snapshots) < 2:
            return {}
        (_, first), (_, last) = self.snapshots[0], self.snapshots[-1]
        out = {}
        for replica in sorted(first.keys() & last.keys()):
            before, after = first[replica], last[replica]
            deltas = sorted(
                ((after.get(t, 0) - before.get(t, 0), t) for t in after.keys() | before.keys()),
                reverse=True,
            )
            rows = [
                {"type": t, "before": before.get(t, 0), "after": after.get(t, 0), "delta": d}
                for d, t in deltas[:top]
                if d > 0
            ]
            total = (sum(before.values()), sum(after.values()))
            rows.append(
                {
                    "type": "(all)",
                    "before": total[0],
                    "after": total[1],
                    "delta": total[1] - total[0],
                }
            )
            out[replica] = rows
        return out


# -- checks ----------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _wait_for(
    read: Callable[[], T], done: Callable[[T], bool], timeout_s: float
) -> tuple[T, float]:
    """``read()`` until ``done`` holds of its value or ``timeout_s`` passed (checked once
    more at the deadline); returns the last value and the seconds waited."""
    began = time.monotonic()
    while True:
        value = read()
        waited = time.monotonic() - began
        if done(value) or waited >= timeout_s:
            return value, waited
        time.sleep(1.0)


def check_memory(memory: Sequence[RoleMemory], bound_pct: float, minutes: float) -> Check:
    judged = [m for m in memory if m.judged]
    worst = max(judged, key=lambda m: m.growth_pct or 0.0, default=None)
    over = "".join(f"; {m.role} {m.growth_pct:+.2f} %" for m in memory if not m.ok)
    largest = f"; largest {worst.role} {worst.growth_pct:+.2f} %" if worst else ""
    return Check(
        "memory flat after warm-up",
        bool(judged) and all(m.ok for m in memory),
        f"{len(judged)} roles judged over the last {minutes:.1f} min, bound "
        f"{bound_pct:g} %{largest}{over}",
    )


def usage_rows(admin: httpx.Client, days: tuple[dt.date, dt.date]) -> list[dict]:
    """Every tenant's usage over ``days``, a row per tenant and model (``GET /admin/usage``)."""
    params = {"start": days[0].isoformat(), "end": days[1].isoformat(), "group": "total"}
    answer = admin.get("/admin/usage", params=params)
    answer.raise_for_status()
    return answer.json()["data"]


def usage_totals(admin: httpx.Client, days: tuple[dt.date, dt.date]) -> dict[str, int]:
    """Every tenant's usage over ``days``, all models summed."""
    totals: Counter[str] = Counter()
    for row in usage_rows(admin, days):
        errors = {f"errors_{name}": n for name, n in row.pop("errors").items()}
        for name, value in {**row, **errors}.items():
            if isinstance(value, int):
                totals[name] += value
    return dict(totals)


def check_usage_counts(
    admin: httpx.Client, days: tuple[dt.date, dt.date], results: Sequence[Result]
) -> Check:
    """A record is written when its response ends (an abandoned stream's once the gateway
    heard its client leave): wait until every request sent is counted."""
    sent = [r for r in results if r.error != DROPPED]
    # Never answered: the gateway may or may not have seen them.
    unanswered = sum(r.status == 0 for r in sent)
    usage, waited = _wait_for(
        lambda: usage_totals(admin, days),
        lambda u: u.get("requests", 0) >= len(sent),
        timeout_s=60,
    )
    counted = usage.get("requests", 0)
    return Check(
        "usage counts every request",
        len(sent) - unanswered <= counted <= len(sent),
        f"usage {counted:,} requests, the clients sent {len(sent):,} ({unanswered} never "
        f"answered); {waited:.0f} s after traffic",
    )


def pool_replicas() -> dict[str, list[dict]]:
    """Each pool's replicas' own stats (engine counters, running, waiting, open streams)."""
    from serve_app.replica import admin as replica_admin

    return {pool: replica_admin.all_stats(APP, f"pool-{pool}") for pool in (PRIMARY, "embed")}


def _busy(stats: dict[str, list[dict]]) -> dict[str, tuple[int, int, int]]:
    """(running, waiting, open streams) of every replica with any."""
    out = {}
    for replicas in stats.values():
        for s in replicas:
            counts = (s["num_requests_running"], s["num_requests_waiting"], s["open_streams"])
            if any(counts):
                out[s["replica"]] = counts
    return out


def check_replicas_idle() -> tuple[Check, dict[str, list[dict]]]:
    """Nothing left running on a replica: every abandoned stream aborted, every slot free.
    Returns the replicas' final stats too (metering's ground truth)."""
    live, waited = _wait_for(pool_replicas, lambda s: not _busy(s), timeout_s=60)
    busy = _busy(live)
    detail = (
        f"every primary and embed replica: nothing running, waiting or streaming "
        f"({waited:.0f} s after the usage settled)"
        if not busy
        else f"(running, waiting, open streams) by replica: {busy}"
    )
    return Check("replicas idle", not busy, detail), live


def engine_totals(
    graph: Graph, live: dict[str, list[dict]], killed: Iterable[KilledReplica]
) -> dict[str, int]:
    """What the backends themselves counted: every live pool replica, each killed one as read
    before its kill, and the mock fallback."""
    stats = [s for replicas in live.values() for s in replicas]
    stats += [k.stats for k in killed]
    stats.append(httpx.get(f"{graph.proxy_url}{MOCK_PREFIX}/stats", timeout=10).json())
    return {
        "prompt_tokens": sum(s["prompt_tokens"] for s in stats),
        "completion_tokens": sum(s["generation_tokens"] for s in stats),
    }


def check_metering(
    usage: dict[str, int],
    engines: dict[str, int],
    killed: Sequence[KilledReplica],
    results: Sequence[Result],
) -> Check:
    """Usage equals the engines' counts, but for requests no backend could count: those
    charged an estimate, and those in flight on a replica when it was killed (counted by it up
    to the read before the kill, then retried elsewhere or cut off). Each is off by at most
    its prompt and its ``max_tokens``."""
    estimated = usage.get("estimated_requests", 0)
    # Where an estimate is expected: a fallback stream the client left (the fallback says
    # nothing about a stream cut short); a primary one is charged its replica's own count.
    abandoned = Counter(r.backend or "none" for r in results if r.stream == "abandon")
    on_killed = sum(
        k.stats["num_requests_running"] + k.stats["num_requests_waiting"] for k in killed
    )
    unknown = estimated + on_killed
    prompt_max, output_max = max_charge()
    off = {k: usage.get(k, 0) - engines[k] for k in ("prompt_tokens", "completion_tokens")}
    ok = (
        abs(off["prompt_tokens"]) <= unknown * prompt_max
        and abs(off["completion_tokens"]) <= unknown * output_max
    )
    return Check(
        "metering equals the engines' counters",
        ok,
        f"prompt {usage.get('prompt_tokens', 0):,} vs engines {engines['prompt_tokens']:,} "
        f"(off {off['prompt_tokens']:+,}), completion {usage.get('completion_tokens', 0):,} vs "
        f"{engines['completion_tokens']:,} (off {off['completion_tokens']:+,}); allowed "
        f"±{unknown * prompt_max:,}/±{unknown * output_max:,} for {unknown} requests no backend "
        f"could count ({estimated} charged an estimate, {on_killed} on killed replicas); "
        f"abandoned streams by backend: {dict(abandoned)}",
    )


def admission_status(admin: httpx.Client) -> dict[str, dict]:
    """Each pool's fair-admission snapshot (pools without admission left out)."""
    answer = admin.get("/admin/status")
    answer.raise_for_status()
    return {p["name"]: p["admission"] for p in answer.json()["pools"] if p["admission"]}


def _admission_idle(pools: dict[str, dict]) -> bool:
    return all(
        a["slots_used"] == 0 and not any(a["inflight"].values()) and not any(a["queued"].values())
        for a in pools.values()
    )


def check_admission(admin: httpx.Client) -> Check:
    """No slot held, queued or parked: a parked slot goes back after ``keep_warm_s`` idle, a
    dead holder's lease after ``lease_ttl_s``; anything past that is a leak."""
    pools, waited = _wait_for(lambda: admission_status(admin), _admission_idle, timeout_s=90)
    detail = "; ".join(
        f"{pool}: {a['slots_used']} of {a['slots_total']} slots used ({a['parked']} parked), "
        f"{sum(a['inflight'].values())} in flight, {sum(a['queued'].values())} queued, "
        f"{a.get('expired_leases', 0)} leases expired"
        for pool, a in pools.items()
    )
    return Check(
        "admission slots back to zero", _admission_idle(pools), f"{detail}; {waited:.0f} s idle"
    )


def gateway_store_errors() -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Store calls each gateway replica counted as failed, by op (``forge_store_errors_total``,
    what ``/admin/status`` shows of the one replica that answers it); and the replicas that did
    not answer within 30 s, with their threads' Python stacks (``python_stacks``)."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.serve._private.constants import SERVE_NAMESPACE

    from serve_app.replica import admin as replica_admin

    def read(_actor) -> dict[str, int]:
        from ray import serve

        return dict(serve.get_replica_context().servable_object.metrics.store_errors_seen)

    out, unanswered = {}, {}
    for rid in replica_admin.replica_ids(APP, "gateway"):
        actor = ray.get_actor(f"SERVE_REPLICA::{APP}#gateway#{rid}", namespace=SERVE_NAMESPACE)
        try:
            out[rid] = ray.get(actor.__ray_call__.remote(read), timeout=30)
        except GetTimeoutError:
            unanswered[rid] = python_stacks(actor)
    return out, unanswered


def python_stacks(actor) -> str:
    """A replica that does not answer: its threads' Python stacks (``py-spy dump``), which tell
    a blocked event loop (and where) from a starved one. A run on 2026-12-07 lost a gateway so,
    right as a pool replica was killed, with nothing left to say why (docs/operations.md, CI)."""
    import ray

    # Ray's GCS actor table (a debugging API): the worker's pid, known while the actor lives.
    pid = ray._private.state.actors(actor_id=actor._actor_id.hex()).get("Pid")
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not pid or not Path(spy).exists():
        return f"(no stacks: pid {pid}, py-spy {'found' if Path(spy).exists() else 'missing'})"
    try:
        done = subprocess.run(
            [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return f"(no stacks: py-spy dump --pid {pid} took over 60 s)"
    return done.stdout or done.stderr


def check_gateways_answer(unanswered: dict[str, str]) -> Check:
    """Every gateway replica still answers a call: one whose event loop is blocked serves no
    request and its usage never reaches the ledger, whatever the other checks read."""
    if unanswered:
        stacks = "".join(f"\n--- {rid}:\n{text}" for rid, text in unanswered.items())
        detail = f"no answer in 30 s from {sorted(unanswered)}; their Python stacks:{stacks}"
        return Check("every gateway answers", False, detail)
    return Check("every gateway answers", True, "each answered a call within 30 s")


def lease_key(tenant: str) -> str:
    """Where the store keeps a tenant's stream leases (``QuotaStage``, Redis's sorted set)."""
    from serve_app.config.models import TenantConfig
    from serve_app.stages.quota_buckets import TenantQuota

    return KEY_PREFIX + TenantQuota.of(TenantConfig(name=tenant, **TENANTS[tenant])).stream_key


def check_leases(redis: PersistentRedis) -> Check:
    """No live stream lease in the store. A release the store missed while it was down leaves
    its lease to expire by TTL (by design): waited for, and said."""
    from serve_app.stages.quota import LEASE_TTL_S

    key = lease_key("capped")
    at_first = redis.live_leases(key)
    left, waited = _wait_for(lambda: redis.live_leases(key), lambda n: n == 0, LEASE_TTL_S + 15)
    return Check(
        "stream leases back to zero",
        left == 0,
        f"capped tenant: {at_first} live when first read, {left} after {waited:.0f} s "
        f"(lease TTL {LEASE_TTL_S:g} s)",
    )


def check_stream_cap(graph: Graph) -> Check:
    """The capped tenant's next request sees the whole cap: store-agnostic proof that no lease
    is left (the embedded store's too)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": traffic.prompt_of(8, "soak-probe")}],
        "max_tokens": 4,
    }
    answer = httpx.post(
        f"{graph.url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {tenant_key('capped')}"},
        timeout=30,
    )
    value = answer.headers.get("x-ratelimit-remaining-concurrent-requests")
    remaining = int(value) if answer.status_code == 200 and value is not None else None
    return Check(
        "stream cap whole again",
        remaining == CAPPED_STREAMS - 1,
        f"HTTP {answer.status_code}; x-ratelimit-remaining-concurrent-requests {remaining} "
        f"(cap {CAPPED_STREAMS}, this request included)",
    )


# -- the run ---------------------------------------------------------------------------------


class Judged:
    """A report's verdict from its ``checks`` (the soak's, and the books drill's)."""

    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


@dataclass
class SoakReport(Judged):
    duration_s: float
    warmup_s: float
    window_s: float
    bound_pct: float
    faults: list[dict]
    memory: list[RoleMemory]
    checks: list[Check]
    traffic: dict
    rounds: list[tuple[float, dict[int, tuple[str, int]]]]
    series: dict[str, list[tuple[float, int]]]
    processes: dict[int, dict]
    census: dict[str, list[dict]]
    started_at: str
    checks_s: float


def _say(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _drive(
    graph: Graph,
    duration_s: float,
    plan: Sequence[Fault],
    injector: FaultInjector,
    sampler: MemorySampler,
    sample_every_s: float,
    census: Census,
    log: Callable[[str], None],
) -> None:
    """Until ``duration_s``: each fault's start and end on time, an RSS round every
    ``sample_every_s``, the object census at its times, a line a minute. Faults still on when
    interrupted are ended."""
    events: list[tuple[float, str, Fault | None]] = sorted(
        [(f.at_s, "start", f) for f in plan]
        + [(f.at_s + f.lasts_s, "end", f) for f in plan]
        + [(t, "census", None) for t in census.at_s],
        key=lambda e: e[0],
    )
    next_sample, next_note = 0.0, 60.0
    try:
        while (now := time.monotonic() - sampler.began) < duration_s:
            while events and events[0][0] <= now:
                _, what, fault = events.pop(0)
                if fault is None:
                    census.take(now)
                    log(f"t={now:5.0f}s object census of {len(census.snapshots[-1][1])} replicas")
                    continue
                try:
                    (injector.start if what == "start" else injector.end)(fault, now)
                except Exception as exc:  # a fault that could not be done is a finding too
                    entry = {"t_s": round(now, 1), "event": f"{fault.kind} {what}"}
                    injector.log.append({**entry, "error": repr(exc)})
                log(f"t={now:5.0f}s {injector.log[-1]}")
            if graph.redis is not None and graph.redis.pid is not None:
                sampler.roles[graph.redis.pid] = "redis-soak"
            if now >= next_sample:
                seen = sampler.sample()
                next_sample += sample_every_s
                if now >= next_note:
                    total = sum(rss for _, rss in seen.values()) / 2**20
                    log(f"t={now:5.0f}s {len(seen)} processes, {total:,.0f} MB RSS in all")
                    next_note += 60.0
            upcoming = min([next_sample] + [e[0] for e in events[:1]])
            time.sleep(max(0.05, min(1.0, upcoming - now)))
    finally:
        for _, what, fault in events:
            if what == "end" and fault is not None:
                with contextlib.suppress(Exception):
                    injector.end(fault, time.monotonic() - sampler.began)


def soak(
    graph: Graph,
    duration_s: float,
    *,
    fault_every_s: float,
    workdir: Path,
    sample_every_s: float = 10.0,
    bound_pct: float = 5.0,
    window_s: float = 60.0,
    seed: int = 0,
    log: Callable[[str], None] = _say,
) -> SoakReport:
    """Drive ``graph`` for ``duration_s`` with a fault every ``fault_every_s`` and an RSS round
    every ``sample_every_s``, then check everything. Memory is judged from the end of the first
    third (warm-up) to the end, each end the median of ``window_s`` of rounds."""
    began_wall = dt.datetime.now(dt.UTC)
    warmup_s = duration_s / 3
    workdir.mkdir(parents=True, exist_ok=True)
    results_path = workdir / "soak-requests.jsonl"
    admin = httpx.Client(
        base_url=graph.url,
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
        trust_env=False,
    )
    injector = FaultInjector(graph, admin)
    plan = fault_plan(duration_s, fault_every_s, graph.redis is not None)
    log(
        f"{duration_s / 60:g} min against {graph.url}; faults at "
        + ", ".join(f"{f.at_s:.0f} s {f.kind}" for f in plan)
    )
    # The traffic from a child process: it keeps every result, and its memory is not Forge's.
    child = multiprocessing.get_context("spawn").Process(
        target=_load_generator,
        args=(graph.url, duration_s, seed, str(results_path)),
        name="soak-loadgen",
    )
    child.start()
    sampler = MemorySampler(os.getpid(), roles={os.getpid(): "driver", child.pid: "loadgen"})
    census = Census(at_s=(warmup_s, duration_s - max(10.0, 2 * sample_every_s)))
    try:
        _drive(graph, duration_s, plan, injector, sampler, sample_every_s, census, log)
        sampler.sample()  # the last round, with traffic's tail in flight
        child.join(timeout=180)
        if child.exitcode != 0:
            raise RuntimeError(f"the load generator exited with {child.exitcode}")
    finally:
        if child.is_alive():
            child.kill()
    traffic_ended = time.monotonic()
    results = traffic.read_jsonl(results_path)
    log(f"traffic done: {len(results):,} requests; checking")

    memory = role_memory(
        sampler.rounds,
        (warmup_s, warmup_s + window_s),
        (duration_s - window_s, duration_s + sample_every_s),
        bound_pct,
    )
    days = (began_wall.date(), dt.datetime.now(dt.UTC).date())
    checks = [
        check_memory(memory, bound_pct, (duration_s - warmup_s) / 60),
        check_usage_counts(admin, days, results),
    ]
    idle, live = check_replicas_idle()
    usage = usage_totals(admin, days)
    engines = engine_totals(graph, live, injector.killed)
    checks += [
        idle,
        check_metering(usage, engines, injector.killed, results),
        check_admission(admin),
    ]
    if graph.redis is not None:
        checks.append(check_leases(graph.redis))
    checks.append(check_stream_cap(graph))
    store_errors, unanswered = gateway_store_errors()
    checks.append(check_gateways_answer(unanswered))
    for c in checks:
        log(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")

    names = [s.name for s in chat_streams()] + [e.name for e in EXTRAS]
    # What a client saw fail, but for the quota's refusals (asked for): the evidence to read.
    failures = [
        {k: v for k, v in asdict(r).items() if k not in ("ttft", "prompt_tokens", "cache")}
        for r in results
        if r.error not in (None, DROPPED, "http_429")
    ]
    report = SoakReport(
        duration_s=duration_s,
        warmup_s=warmup_s,
        window_s=window_s,
        bound_pct=bound_pct,
        faults=injector.log,
        memory=memory,
        checks=checks,
        traffic={
            "streams": {n: traffic.summarize(results, n) for n in names},
            "all": traffic.summarize(results),
            "table": _traffic_table(results, names),
            "usage": usage,
            "usage_rows": usage_rows(admin, days),
            "engines": engines,
            "killed_replicas": [asdict(k) for k in injector.killed],
            "store_errors": store_errors,
            "failures": failures,
            # To find an abandoned stream in the replicas' logs (by request id).
            "abandoned": [
                {"request_id": r.request_id, "backend": r.backend, "start": round(r.start, 1)}
                for r in results
                if r.stream == "abandon"
            ],
        },
        rounds=sampler.rounds,
        series=sampler.by_role(),
        processes=sampler.processes,
        census=census.growth(),
        started_at=began_wall.isoformat(timespec="seconds"),
        checks_s=round(time.monotonic() - traffic_ended, 1),
    )
    admin.close()
    return report


def _traffic_table(results: list[Result], names: list[str]) -> str:
    from loadtest.profiles import table

    return table(results, names)


# -- outputs ---------------------------------------------------------------------------------


def write_outputs(report: SoakReport, out: Path, command: str) -> list[Path]:
    """``<out>.json``, ``<out>.csv``, ``<out>.png`` and ``<out>.md``; returns the paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(s) for s in (".json", ".csv", ".png", ".md")]
    data = {
        "command": command,
        "machine": _machine(),
        "started_at": report.started_at,
        "duration_s": report.duration_s,
        "warmup_s": report.warmup_s,
        "window_s": report.window_s,
        "bound_pct": report.bound_pct,
        "ok": report.ok,
        "checks": [asdict(c) for c in report.checks],
        "memory": [asdict(m) for m in report.memory],
        "faults": report.faults,
        "checks_s": report.checks_s,
        "traffic": {k: v for k, v in report.traffic.items() if k != "table"},
        "processes": report.processes,
        "census_growth": report.census,
        "series_mb": {
            role: [[round(t, 1), round(rss / 2**20, 1)] for t, rss in points]
            for role, points in report.series.items()
        },
    }
    paths[0].write_text(json.dumps(data, indent=1))
    with paths[1].open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["t_s", "pid", "role", "rss_bytes"])
        for t, seen in report.rounds:
            for pid, (role, rss) in sorted(seen.items()):
                writer.writerow([f"{t:.1f}", pid, role, rss])
    plot(report, paths[2])
    paths[3].write_text(markdown(report, command, paths[2].name))
    return paths


def _machine() -> str:
    import platform

    import psutil

    return (
        f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    )


def plot(report: SoakReport, path: Path) -> None:
    """Three panels over time: the Serve replicas' RSS, the rest's (log scale: the dashboard's
    modules dwarf the raylet), and every judged role relative to its warm-up end, where a leak
    is a line that leaves the bound's band."""
    import matplotlib

    from loadtest.plots import save, subplots

    forge = sorted(r for r in report.series if ":" in r)
    system = sorted(r for r in report.series if ":" not in r and r != "other")
    judged = [m.role for m in report.memory if m.judged]
    # Ten colours, then the same ten dashed: twenty roles stay tellable apart.
    colours = matplotlib.colormaps["tab10"]
    style = {
        role: {"color": colours(i % 10), "linestyle": ("-", "--", "-.")[i // 10 % 3]}
        for i, role in enumerate(sorted(report.series))
    }
    minutes = report.duration_s / 60
    fig, axes = subplots(3, 1, figsize=(12, 12), sharex=True)
    for ax, roles in ((axes[0], forge), (axes[1], system)):
        for role in roles:
            points = report.series[role]
            ax.plot(
                [t / 60 for t, _ in points],
                [rss / 2**20 for _, rss in points],
                label=role,
                linewidth=1.2,
                **style[role],
            )
        ax.set_ylabel("RSS, MB")
    axes[1].set_yscale("log")
    start = report.warmup_s, report.warmup_s + report.window_s
    for role in judged:
        points = report.series[role]
        base = statistics.median(rss for t, rss in points if start[0] <= t <= start[1])
        shown = [(t / 60, (rss / base - 1) * 100) for t, rss in points if t >= report.warmup_s]
        axes[2].plot(*zip(*shown, strict=True), label=role, linewidth=1.0, **style[role])
    axes[2].axhspan(-report.bound_pct, report.bound_pct, color="#2b7bba", alpha=0.08)
    axes[2].set_ylabel("RSS vs warm-up end, %")
    axes[2].set_xlabel("minutes (red lines: faults; grey: warm-up; blue band: the bound)")
    titles = (
        "Serve replicas (app:deployment), summed per role",
        "Ray, the driver, Redis and the load generator (log scale)",
        "Judged roles against their RSS at the warm-up's end (a drop: a replica killed)",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.axvspan(0, report.warmup_s / 60, color="grey", alpha=0.12)
        for fault in report.faults:
            if fault["event"].endswith("start"):
                ax.axvline(fault["t_s"] / 60, color="#c0392b", alpha=0.35, linewidth=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, minutes)
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"Soak, {minutes:g} min: RSS per role "
        f"({'all checks pass' if report.ok else 'checks FAILED'})"
    )
    save(fig, path)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def markdown(report: SoakReport, command: str, png: str) -> str:
    lines = [
        f"# Soak, {report.duration_s / 60:g} minutes ({report.started_at})",
        "",
        f"`{command}` on {_machine()}.",
        "",
        f"Warm-up: the first {report.warmup_s / 60:.1f} min. RSS at the warm-up's end and at the "
        f"end: medians over {report.window_s:g} s of samples. Growth is measured on the processes "
        f"alive through the whole window (a killed replica's replacement is not), bound "
        f"{report.bound_pct:g} %.",
        "",
        f"![RSS per role]({png})",
        "",
        "## Checks",
        "",
        "| check | result | detail |",
        "|---|---|---|",
        *(f"| {c.name} | {'ok' if c.ok else '**FAIL**'} | {c.detail} |" for c in report.checks),
        "",
        "## Memory per role",
        "",
        "| role | processes (start/end) | RSS at warm-up end, MB | RSS at end, MB | "
        "measured processes | their RSS start → end, MB | growth | trend, MB/h | judged |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in report.memory:
        growth = "-" if m.growth_pct is None else f"{m.growth_pct:+.2f} %"
        trend = "-" if m.trend_mb_per_h is None else f"{m.trend_mb_per_h:+.1f}"
        if m.judged:
            verdict = "ok" if m.ok else "**over**"
        elif judged_role(m.role):
            verdict = "not measured: no process lived through the window"
        else:
            verdict = "shown only"
        lines.append(
            f"| {m.role} | {m.processes_start}/{m.processes_end} | {_mb(m.start_mb)} | "
            f"{_mb(m.end_mb)} | {m.survivors} | {_mb(m.survivors_start_mb)} → "
            f"{_mb(m.survivors_end_mb)} | {growth} | {trend} | {verdict} |"
        )
    lines += [
        "",
        "## Faults",
        "",
        "| t, s | event | detail |",
        "|---:|---|---|",
        *(
            f"| {f['t_s']:.0f} | {f['event']} | "
            + ", ".join(f"{k} {v}" for k, v in f.items() if k not in ("t_s", "event"))
            + " |"
            for f in report.faults
        ),
        "",
        "## Traffic",
        "",
        report.traffic["table"],
        "",
        "Usage report (every tenant, the run's days): "
        + ", ".join(f"{k} {v:,}" for k, v in sorted(report.traffic["usage"].items()) if v)
        + ".",
        "",
        "Store calls the gateway replicas counted as failed (by op, the Redis restarts "
        "included): "
        + "; ".join(
            f"{rid}: " + (", ".join(f"{op} {n}" for op, n in sorted(ops.items())) or "none")
            for rid, ops in report.traffic["store_errors"].items()
        )
        + ".",
        "",
        *_failures_lines(report.traffic["failures"], report.faults),
        *_census_lines(report.census),
    ]
    return "\n".join(lines)


def _failures_lines(failures: list[dict], faults: list[dict]) -> list[str]:
    """Client-visible failures but 429s, each by the fault that was last started before it."""

    def during(t: float) -> str:
        started = [f for f in faults if f["event"].endswith("start") and f["t_s"] <= t]
        return (
            f"after {started[-1]['event'][:-6]} at {started[-1]['t_s']:.0f} s"
            if started
            else "before any fault"
        )

    counts = Counter(
        (f["stream"], f["error"], f["backend"] or "-", during(f["start"])) for f in failures
    )
    lines = ["## Failures a client saw (429s aside)", ""]
    if not counts:
        return [*lines, "None.", ""]
    lines += ["| stream | error | backend | when | requests |", "|---|---|---|---|---:|"]
    lines += [f"| {s} | {e} | {b} | {w} | {n} |" for (s, e, b, w), n in sorted(counts.items())]
    return [*lines, ""]


def _census_lines(census: dict[str, list[dict]]) -> list[str]:
    """The object census: which gc-tracked types grew in each replica over the judged window."""
    if not census:
        return []
    lines = [
        "## Objects that grew (gc-tracked, warm-up end → end, per replica)",
        "",
        "| replica | type | before | after | delta |",
        "|---|---|---:|---:|---:|",
    ]
    for replica, grown in census.items():
        lines += [
            f"| {replica} | `{g['type']}` | {g['before']:,} | {g['after']:,} | {g['delta']:+,} |"
            for g in grown
        ]
    return [*lines, ""]


# -- the CLI ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--fault-every", type=float, default=4.0, help="minutes between faults")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds")
    parser.add_argument("--bound", type=float, default=5.0, help="RSS growth allowed, percent")
    parser.add_argument("--window", type=float, default=60.0, help="seconds averaged at each end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/soak"))
    args = parser.parse_args(argv)
    command = "python -m loadtest.soak " + " ".join(argv if argv is not None else sys.argv[1:])

    import ray

    redis = PersistentRedis() if shutil.which("redis-server") else None
    if redis is None:
        _say("no redis-server: the embedded store, and no Redis restarts")
    try:
        if redis is not None:
            redis.start()
        proxy = start_ray()
        graph = deploy(proxy, redis)
        with tempfile.TemporaryDirectory(prefix="forge-soak-") as workdir:
            report = soak(
                graph,
                args.minutes * 60,
                fault_every_s=args.fault_every * 60,
                sample_every_s=args.sample_every,
                bound_pct=args.bound,
                window_s=args.window,
                seed=args.seed,
                workdir=Path(workdir),
            )
        for path in write_outputs(report, args.out, command):
            _say(f"wrote {path}")
    finally:
        ray.shutdown()
        if redis is not None:
            redis.close()
    if not report.ok:
        _say("FAILED: " + "; ".join(c.name for c in report.failed()))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
