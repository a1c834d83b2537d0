"""Flat in tenants: the hot path's cost with 10, 1,000 and 10,000 configured tenants.

    python -m loadtest.tenants [--tenants 10 1000 10000] [--stores redis memory]
        [--redis-url redis://127.0.0.1:6379/15] [--requests 400] [--rounds 15]
        [--profile-rounds 3] [--no-side] [--out loadtest/results/tenants.json]

One worker process per (tenants, store): it builds a Forge config with N tenants (each its own
API key hash, limits, weight and tier: even tenants interactive, odd ones batch), wires the
gateway in process without Ray (``serve_app/local.py``: a zero-delay simulated engine that
streams 16 tokens, fair admission on, the store on Redis or embedded), and warms it with one
request per tenant, so every tenant has its bucket keys in the store, its digest in the key ring,
its label sets in the metrics and its counters in the scheduler. The parent then runs rounds: in
each, every worker in a fresh random order drives ``--requests`` streaming chat requests, one at
a time, each for a tenant drawn at random from its N, through httpx's ``ASGITransport``, and
reports the CPU its process spent (``time.process_time``, the client, gateway, replica and
engine all included) and each request's wall time. Interleaving the workers round by round
cancels the machine's drift; the table is the median over rounds, and the ratio is to the
smallest N on the same store. Each round also reports the CPU the cyclic garbage collector
took (a full collection scans the whole heap, which grows with tenants). Last, a few rounds run
under a CPU-time profiler (``cProfile`` on ``process_time``, so other processes' load is not
charged to whatever function was preempted) and split Forge's own CPU per request file by file,
with the gateway's files totalled apart from the replica's and engine's: a tighter check than
the whole process, which includes the client, Starlette and the engine.

The budgets never bite (bursts of a million requests and a billion tokens) and refill slowly
(``rpm: 1``, ``tpm: 6``); after the warm-up each tenant's buckets are drawn down once more, so
their keys (which live twice their bucket's time to refill) outlive the run: every tenant's keys
are in the store while the rounds run (each worker reports how many before and after).

Besides the request path, ``side`` measures the work that scales with tenants off it: config
validation at start-up, the scheduler deployment's once-a-second gauge export, the embedded
store's periodic sweep, and one grant of the fair scheduler while W tenants wait.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import hashlib
import json
import os
import platform
import pstats
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

MODEL = "forge-sim"
KEY_PREFIX = "forge-tenants:"  # every store key of this benchmark, in the Redis db given
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Say sixteen words about gateways."}],
    "max_tokens": 16,
    "stream": True,
}
# Taken once from each tenant's buckets after the warm-up: their keys then live for hours.
PIN_REQUESTS, PIN_TOKENS = 1_000, 100_000
ENGINE = {"output_tokens_min": 16, "output_tokens_max": 16, "max_num_seqs": 256}


def tenant_name(i: int) -> str:
    return f"tenant-{i:05d}"


def api_key(i: int) -> str:
    return f"sk-tenants-bench-{i:05d}-local-only"


def forge_args(n: int, redis_url: str | None) -> dict:
    tenants = [
        {
            "name": tenant_name(i),
            "key_hashes": [hashlib.sha256(api_key(i).encode()).hexdigest()],
            "tier": "batch" if i % 2 else "interactive",
            "weight": 1 + i % 4,
            "queue_cap": 4 + i % 5,
            "limits": {
                "rpm": 1,
                "burst_requests": 10**6,
                "tpm": 6,
                "burst_tokens": 10**9,
                "max_concurrent_streams": 8,
            },
        }
        for i in range(n)
    ]
    # A patient store: on a busy 2-core machine a 50 ms (default) timeout fails requests open,
    # which would measure the unmetered path; failures are counted and reported either way.
    store = (
        {"redis_url": redis_url, "key_prefix": f"{KEY_PREFIX}{n}:", "timeout_s": 2.0}
        if redis_url
        else {}
    )
    return {
        "store": store,
        "tenants": tenants,
        "pools": [
            {
                "name": "primary",
                "model": MODEL,
                "engine": ENGINE,
                "fallback": False,
                "admission": {"max_inflight": 64, "queue_cap": 8},
            }
        ],
    }


# -- worker: one gateway in this process, driven by the parent over stdin/stdout --------------


class _Counted:
    """A metrics counter that also counts here: the store and scheduler failures (fail-open
    requests) a run must not hide."""

    total = 0

    def __init__(self, counter) -> None:
        self.counter = counter

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        _Counted.total += 1
        self.counter.inc(value, tags=tags)


async def _one(client, i: int) -> tuple[float, bool]:
    started = time.perf_counter()
    async with client.stream(
        "POST",
        "/v1/chat/completions",
        json=BODY,
        headers={"authorization": f"Bearer {api_key(i)}"},
    ) as response:
        body = b"".join([chunk async for chunk in response.aiter_bytes()])
    ok = response.status_code == 200 and body.rstrip().endswith(b"data: [DONE]")
    return time.perf_counter() - started, ok


async def _worker(n: int, redis_url: str | None) -> None:
    import httpx

    from serve_app.config.models import load_config
    from serve_app.local import build_local_gateway
    from serve_app.metrics import ForgeMetrics

    out = sys.stdout
    sys.stdout = sys.stderr  # the protocol owns stdout
    t0 = time.perf_counter()
    config = load_config(forge_args(n, redis_url))
    metrics = ForgeMetrics()
    metrics.store_errors = _Counted(metrics.store_errors)
    metrics.unmetered = _Counted(metrics.unmetered)
    metrics.admission_errors = _Counted(metrics.admission_errors)
    gateway = build_local_gateway(config, metrics=metrics)
    built_s = time.perf_counter() - t0
    app = gateway.asgi_app()
    transport = httpx.ASGITransport(app)
    async with (
        gateway.lifespan(),
        httpx.AsyncClient(transport=transport, base_url="http://forge.test", timeout=30) as client,
    ):
        # Warm: one request per tenant (eight at a time), so all of its state exists.
        t0 = time.perf_counter()
        failed = 0
        gate = asyncio.Semaphore(8)

        async def warm(i: int) -> None:
            nonlocal failed
            async with gate:
                _, ok = await _one(client, i)
                failed += not ok

        await asyncio.gather(*(warm(i) for i in range(n)))
        await _pin_buckets(gateway)
        warm_s = time.perf_counter() - t0
        reply = {
            "ready": True,
            "built_s": built_s,
            "warm_s": warm_s,
            "warm_failed": failed,
            "warm_failed_open": _Counted.total,
            **(await _state(gateway)),
        }
        loop = asyncio.get_running_loop()
        while True:
            print(json.dumps(reply), file=out, flush=True)
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                break
            command = json.loads(line)
            if command["op"] == "run":
                reply = await _run(
                    client, n, command["requests"], command["seed"], command.get("profile", False)
                )
            elif command["op"] == "state":
                reply = await _state(gateway)
            else:
                break


async def _pin_buckets(gateway) -> None:
    """Draw every tenant's buckets well below full, so their keys outlive the run (a key lives
    twice its bucket's time to refill): as if each tenant had used part of its burst."""
    from serve_app.stages.quota import QuotaStage
    from serve_app.store import StoreError

    quota = gateway.pipeline.stage(QuotaStage)
    gate = asyncio.Semaphore(16)

    async def pin(q) -> None:
        buckets, _ = q.plan(0)
        amounts = [PIN_REQUESTS if b is q.requests else PIN_TOKENS for b in buckets]
        async with gate:
            for attempt in range(5):
                try:
                    await gateway.store.take(buckets, amounts)
                    return
                except StoreError:
                    await asyncio.sleep(0.2 * (attempt + 1))
            raise RuntimeError(f"could not pin tenant {q.tenant}'s buckets")

    await asyncio.gather(*(pin(q) for q in quota.quotas.values()))


async def _run(client, n: int, requests: int, seed: int, profile: bool = False) -> dict:
    rng = random.Random(seed)
    picks = [rng.randrange(n) for _ in range(requests)]
    latencies = []
    errors = 0
    failed_open = _Counted.total
    gc_time = _GcTime()
    profiler = cProfile.Profile(time.process_time) if profile else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with gc_time:
        if profiler is not None:
            profiler.enable()
        for i in picks:
            latency, ok = await _one(client, i)
            latencies.append(latency)
            errors += not ok
        if profiler is not None:
            profiler.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    result = {
        "cpu_us_per_request": cpu / requests * 1e6,
        "wall_us_per_request": wall / requests * 1e6,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": sorted(latencies)[min(requests - 1, int(0.99 * requests))] * 1e3,
        "max_ms": max(latencies) * 1e3,
        "errors": errors,
        "failed_open": _Counted.total - failed_open,
        "gc_us_per_request": gc_time.cpu_s / requests * 1e6,
        "gc_collections": gc_time.collections,
        "distinct_tenants": len(set(picks)),
    }
    if profiler is not None:
        result["own_us_per_request"] = _own_time_by_file(profiler, requests)
    return result


class _GcTime:
    """CPU spent in the cyclic garbage collector while in the block (it scans the whole heap
    on a full collection, and the heap grows with tenants), and collections by generation."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.cpu_s += time.process_time() - self._started
            self.collections[info["generation"]] += 1

    def __enter__(self) -> _GcTime:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def _own_time_by_file(profiler: cProfile.Profile, requests: int) -> dict[str, float]:
    """CPU µs per request spent in each of Forge's files itself (not in what they call)."""
    own: dict[str, float] = {}
    root = str(Path(__file__).resolve().parent.parent) + os.sep
    for (file, _, _), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        if file.startswith(root + "serve_app"):
            name = file.removeprefix(root)
            own[name] = own.get(name, 0.0) + tottime / requests * 1e6
    return dict(sorted(own.items()))


async def _state(gateway) -> dict:
    """How much per-tenant state the worker holds (outside any measured window)."""
    from serve_app.stages.admission import AdmissionStage
    from serve_app.stages.authenticate import AuthStage
    from serve_app.stages.quota import QuotaStage
    from serve_app.store import GuardedStore, MemoryStore, RedisStore

    keyring = gateway.pipeline.stage(AuthStage).keyring
    quota = gateway.pipeline.stage(QuotaStage)
    scheduler = _scheduler_of(gateway.pipeline.stage(AdmissionStage))
    store = gateway.store
    inner = store.store if isinstance(store, GuardedStore) else store
    if isinstance(inner, MemoryStore):
        now = inner._clock()
        keys = sum(1 for e in inner._data.values() if e.expires_at > now)
    elif isinstance(inner, RedisStore):
        keys = 0
        async for _ in inner._client.scan_iter(match=inner._prefix + "*", count=1000):
            keys += 1
    else:
        keys = -1
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # peak, in KiB on Linux
    return {
        "max_rss_mb": round(rss_kb / 1024, 1),
        "keyring_digests": len(keyring._by_hash),
        "quota_tenants": len(quota.quotas),
        "scheduler_tenants": len(getattr(scheduler, "_tenants", ())),
        "scheduler_granted_tenants": len(getattr(scheduler, "_granted", ())),
        "store_keys_live": keys,
    }


def _scheduler_of(admission):
    """The in-process ``FairScheduler`` behind the admission stage (its one pool's)."""
    slots = next(iter(admission.slots.values()))
    return slots.client.scheduler


# -- parent ------------------------------------------------------------------------------------


class Worker:
    def __init__(self, n: int, store: str, redis_url: str) -> None:
        self.n, self.store = n, store
        argv = [sys.executable, "-m", "loadtest.tenants", "--worker", str(n)]
        if store == "redis":
            argv += ["--redis-url", redis_url]
        # Its log (one access-log line per request, as in a replica) goes to a file.
        self.log_path = Path(tempfile.gettempdir()) / f"forge-tenants-{store}-{n}.log"
        self._log = open(self.log_path, "w")  # closed in close()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        self.ready = self._reply()

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.store} N={self.n} died (see {self.log_path})")
        return json.loads(line)

    def ask(self, **command) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


def _clear(redis_url: str) -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=KEY_PREFIX + "*", count=1000))
    for i in range(0, len(keys), 1000):
        client.unlink(*keys[i : i + 1000])
    client.close()
    return len(keys)


def _median(rounds: list[dict], field: str) -> float:
    return statistics.median(r[field] for r in rounds)


def measure(args) -> dict:
    configs = [(n, store) for store in args.stores for n in args.tenants]
    if "redis" in args.stores:
        _clear(args.redis_url)
    workers: dict[tuple[int, str], Worker] = {}
    try:
        # Largest last: its warm-up is the most recent when the rounds start.
        for n, store in sorted(configs):
            print(f"starting {store} N={n} ...", file=sys.stderr, flush=True)
            workers[n, store] = Worker(n, store, args.redis_url)
            print(f"  {json.dumps(workers[n, store].ready)}", file=sys.stderr, flush=True)
        rounds: dict[tuple[int, str], list[dict]] = {c: [] for c in configs}
        rng = random.Random(args.seed)
        for r in range(args.rounds):
            order = list(configs)
            rng.shuffle(order)
            for config in order:
                result = workers[config].ask(op="run", requests=args.requests, seed=rng.random())
                rounds[config].append(result)
            line = "  ".join(
                f"{s[0]}:{n}={rounds[n, s][-1]['cpu_us_per_request']:.0f}" for n, s in configs
            )
            print(f"round {r + 1}/{args.rounds} cpu µs/req  {line}", file=sys.stderr, flush=True)
        # More rounds under a CPU-time profiler: Forge's own code, file by file.
        profiled: dict[tuple[int, str], list[dict]] = {c: [] for c in configs}
        for r in range(args.profile_rounds):
            order = list(configs)
            rng.shuffle(order)
            for config in order:
                profiled[config].append(
                    workers[config].ask(
                        op="run", requests=args.requests, seed=rng.random(), profile=True
                    )
                )
            print(f"profiled round {r + 1}/{args.profile_rounds}", file=sys.stderr, flush=True)
        after = {c: workers[c].ask(op="state") for c in configs}
    finally:
        for worker in workers.values():
            worker.close()
        if "redis" in args.stores:
            _clear(args.redis_url)

    table = []
    for store in args.stores:
        base = None
        for n in args.tenants:
            rs = rounds[n, store]
            cpu = _median(rs, "cpu_us_per_request")
            p50 = _median(rs, "p50_ms")
            cpu_min = min(r["cpu_us_per_request"] for r in rs)
            base = base or (cpu, p50, cpu_min)
            table.append(
                {
                    "store": store,
                    "tenants": n,
                    "cpu_us_per_request": round(cpu, 1),
                    "cpu_ratio": round(cpu / base[0], 3),
                    "cpu_min_us_per_request": round(cpu_min, 1),
                    "cpu_min_ratio": round(cpu_min / base[2], 3),
                    "wall_p50_ms": round(p50, 3),
                    "p50_ratio": round(p50 / base[1], 3),
                    "wall_p99_ms": round(_median(rs, "p99_ms"), 3),
                    "wall_max_ms": round(_median(rs, "max_ms"), 3),
                    "cpu_spread_pct": round(
                        100
                        * (
                            max(r["cpu_us_per_request"] for r in rs)
                            - min(r["cpu_us_per_request"] for r in rs)
                        )
                        / cpu,
                        1,
                    ),
                    "errors": sum(r["errors"] for r in rs),
                    "failed_open": sum(r["failed_open"] for r in rs),
                    "gc_us_per_request": round(_median(rs, "gc_us_per_request"), 1),
                    "warm": workers[n, store].ready,
                    "state_after": after[n, store],
                    "rounds": rs,
                }
            )
    profile = []
    for store in args.stores:
        base = None
        for n in args.tenants:
            runs = profiled[n, store]
            if not runs:
                continue
            files = sorted(set().union(*(r["own_us_per_request"] for r in runs)))
            by_file = {
                f: statistics.median(r["own_us_per_request"].get(f, 0.0) for r in runs)
                for f in files
            }
            gateway = [_gateway_own(r["own_us_per_request"]) for r in runs]
            replica = [
                sum(r["own_us_per_request"].values()) - g
                for r, g in zip(runs, gateway, strict=True)
            ]
            # The replica and engine do the same work whatever N is: gateway ÷ replica cancels a
            # round the machine made uniformly slower.
            relative = statistics.median(g / r for g, r in zip(gateway, replica, strict=True))
            base = base or (statistics.median(gateway), relative)
            profile.append(
                {
                    "store": store,
                    "tenants": n,
                    "gateway_own_us_per_request": round(statistics.median(gateway), 1),
                    "gateway_ratio": round(statistics.median(gateway) / base[0], 3),
                    "replica_own_us_per_request": round(statistics.median(replica), 1),
                    "gateway_per_replica": round(relative, 3),
                    "gateway_per_replica_ratio": round(relative / base[1], 3),
                    "by_file": {k: round(v, 2) for k, v in by_file.items()},
                }
            )
    return {"table": table, "profile": profile}


# -- off the request path: what else scales with tenants ---------------------------------------


def side(tenants: list[int]) -> dict:
    """Start-up and periodic work that grows with tenants, and the scheduler under contention."""
    from serve_app.config.models import load_config

    results: dict[str, list] = {
        "config_validation": [],
        "scheduler_export": [],
        "memory_sweep": [],
        "contended_grant": [],
    }
    for n in tenants:
        args = forge_args(n, None)
        t0 = time.perf_counter()
        config = load_config(args)
        results["config_validation"].append(
            {"tenants": n, "ms": round((time.perf_counter() - t0) * 1e3, 2)}
        )
        results["scheduler_export"].append({"tenants": n, **_scheduler_export(config)})
        results["memory_sweep"].append({"tenants": n, **_memory_sweep(config)})
        print(
            f"side N={n}: {json.dumps({k: v[-1] for k, v in results.items() if v})}",
            file=sys.stderr,
            flush=True,
        )
    for waiting in tenants:
        results["contended_grant"].append({"waiting_tenants": waiting, **_contended(waiting)})
        print(f"side: {json.dumps(results['contended_grant'][-1])}", file=sys.stderr, flush=True)
    return results


def _scheduler_export(config) -> dict:
    """One pass of the scheduler deployment's housekeeping (it runs once a second)."""
    from serve_app.admission.deployment import SchedulerDeployment

    pool = config.pools[0]
    deployment = SchedulerDeployment(
        pool.name, pool.admission.model_dump(), [t.model_dump() for t in config.tenants]
    )

    async def once() -> float:
        cpu0 = time.process_time()
        deployment._ensure_housekeeping()
        await asyncio.sleep(0)  # the first pass runs up to its sleep
        cpu = time.process_time() - cpu0
        deployment._housekeeping.cancel()
        return cpu

    cpus = [asyncio.run(once()) for _ in range(3)]
    return {"ms_per_pass": round(statistics.median(cpus) * 1e3, 2)}


def _memory_sweep(config) -> dict:
    """The embedded store dropping keys nobody reads again: every tenant's two buckets live on
    (drawn down, as in the workers) and one more key per tenant expires; after the sweep
    interval, the worst single write while the expired keys go, and how many writes that took.
    A fresh store in a hot cache: in a gateway that has idled, its keys are cold and a scan of
    them costs several times more."""
    from serve_app.stages.quota_buckets import TenantQuota
    from serve_app.store import Bucket, MemoryStore
    from serve_app.store import memory as memory_module

    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    quotas = [TenantQuota.of(t) for t in config.tenants]

    async def fill_and_sweep() -> tuple[float, int, int]:
        for q in quotas:
            buckets, _ = q.plan(0)
            await store.take(buckets, [PIN_REQUESTS, PIN_TOKENS])
            await store.take([Bucket(f"short:{{{q.tenant}}}", 100, 100)], [1])  # lives 5 s
        live = 2 * len(quotas) + 1
        probe = quotas[0]
        now[0] += memory_module.SWEEP_INTERVAL_S
        worst, writes = 0.0, 0
        while len(store) > live and writes < 10 * len(quotas):
            t0 = time.perf_counter()
            await store.take(*probe.plan(30))
            worst = max(worst, time.perf_counter() - t0)
            writes += 1
        return worst, writes, len(store)

    worst, writes, keys = asyncio.run(fill_and_sweep())
    return {
        "keys_before": 3 * len(quotas),
        "keys_after": keys,
        "writes_to_drop_expired": writes,
        "worst_write_ms": round(worst * 1e3, 3),
    }


def _contended(waiting: int) -> dict:
    """CPU of one grant (release → the next waiter) while ``waiting`` tenants each have one
    request queued: what every grant costs under overload."""
    from serve_app.admission.scheduler import FairScheduler, TenantShare

    async def run() -> float:
        tenants = {
            tenant_name(i): TenantShare(weight=1 + i % 4, tier="batch" if i % 2 else "interactive")
            for i in range(waiting)
        }
        scheduler = FairScheduler(1, tenants=tenants, lease_ttl_s=3600)
        held = await scheduler.acquire("holder", deadline_s=60)
        waiters = [asyncio.ensure_future(scheduler.acquire(t, deadline_s=600)) for t in tenants]
        await asyncio.sleep(0)
        grants = min(200, waiting)
        cpu0 = time.process_time()
        lease = held.lease_id
        for _ in range(grants):
            scheduler.release(lease)  # hands the slot to the next waiter, picked fairly
            (lease,) = scheduler._leases
        cpu = time.process_time() - cpu0
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        return cpu / grants

    return {"us_per_grant": round(asyncio.run(run()) * 1e6, 1)}


# The replica and its simulated engine (in process here, a separate deployment on Serve): the
# rest of Forge's files are the gateway's.
_REPLICA_SIDE = (
    "serve_app/engines/",
    "serve_app/replica/server.py",
    "serve_app/replica/faults.py",
    "serve_app/kvcache/block_hashes.py",
)


def _gateway_own(own: dict[str, float]) -> float:
    return sum(v for k, v in own.items() if not k.startswith(_REPLICA_SIDE))


def _print_profile(result: dict) -> None:
    """Forge's own CPU per request, file by file (profiled rounds, medians: absolute numbers
    are inflated by the profiler, the comparison between N is what counts)."""
    rows = result["profile"]
    if not rows:
        return
    for store in dict.fromkeys(r["store"] for r in rows):
        mine = [r for r in rows if r["store"] == store]
        files = sorted(set().union(*(r["by_file"] for r in mine)))
        print(f"\n{store}: Forge's own CPU µs/request (profiled)")
        print(f"{'file':<40}" + "".join(f"{'N=' + str(r['tenants']):>10}" for r in mine))
        for name in files:
            values = "".join(f"{r['by_file'].get(name, 0.0):>10.1f}" for r in mine)
            print(f"{name.removeprefix('serve_app/'):<40}{values}")
        for label, field, fmt in (
            ("gateway (all but replica side)", "gateway_own_us_per_request", ".1f"),
            ("  ratio", "gateway_ratio", ".3f"),
            ("replica side (replica, engine)", "replica_own_us_per_request", ".1f"),
            ("gateway ÷ replica side", "gateway_per_replica", ".3f"),
            ("  ratio", "gateway_per_replica_ratio", ".3f"),
        ):
            print(f"{label:<40}" + "".join(f"{r[field]:>10{fmt}}" for r in mine))


def _print_table(result: dict) -> None:
    print(
        f"{'store':<7}{'tenants':>8}{'CPU µs/req':>12}{'ratio':>7}{'min':>8}{'ratio':>7}"
        f"{'p50 ms':>9}{'ratio':>7}{'p99 ms':>9}{'max ms':>9}{'spread':>8}{'errors':>7}"
    )
    for row in result["table"]:
        print(
            f"{row['store']:<7}{row['tenants']:>8}{row['cpu_us_per_request']:>12.1f}"
            f"{row['cpu_ratio']:>7.3f}{row['cpu_min_us_per_request']:>8.1f}"
            f"{row['cpu_min_ratio']:>7.3f}{row['wall_p50_ms']:>9.3f}{row['p50_ratio']:>7.3f}"
            f"{row['wall_p99_ms']:>9.3f}{row['wall_max_ms']:>9.3f}{row['cpu_spread_pct']:>7.1f}%"
            f"{row['errors'] + row['failed_open']:>7}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, nargs="+", default=[10, 1000, 10000])
    parser.add_argument(
        "--stores", nargs="+", choices=["redis", "memory"], default=["redis", "memory"]
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--requests", type=int, default=400, help="per worker and round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument(
        "--profile-rounds", type=int, default=3, help="rounds under the profiler (0: none)"
    )
    parser.add_argument("--no-side", action="store_true", help="skip the off-path measurements")
    parser.add_argument("--out", default="loadtest/results/tenants.json")
    parser.add_argument("--side-only", action="store_true", help="only the off-path measurements")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        redis_url = args.redis_url if "--redis-url" in sys.argv else None
        asyncio.run(_worker(args.worker, redis_url))
        return

    if args.side_only:
        print(json.dumps(side(args.tenants), indent=1))
        return
    started = time.time()
    result = {
        "command": "python -m loadtest.tenants " + " ".join(sys.argv[1:]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_at_start": os.getloadavg(),
        },
        "settings": {
            "tenants": args.tenants,
            "stores": args.stores,
            "requests": args.requests,
            "rounds": args.rounds,
            "engine": ENGINE,
            "body": BODY,
        },
        **measure(args),
    }
    if not args.no_side:
        result["side"] = side(args.tenants)
    result["duration_s"] = round(time.time() - started, 1)
    _print_table(result)
    _print_profile(result)
    if not args.no_side:
        print(json.dumps(result["side"], indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
