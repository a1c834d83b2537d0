"""The books drill: the store and the gateways fail, and afterwards the books still balance.

    python -m loadtest.books --minutes 4 --repeat 3 --out loadtest/results/books --check
    python -m loadtest.books --quick --check                  # CI: ~1 min of traffic

The soak's graph (``loadtest/soak.py``: two gateway replicas on a private Redis with an
append-only file, a primary pool of two behind fair admission, an embedding pool, the mock
fallback; its SQLite ledger a file of its own) with ``--tenants`` more tenants that flood past a
budget (alternately requests/min and tokens/min bound), beside the soak's traffic: four tenants,
streams and not, completions, embeddings, temperature-0 repeats (cache hits) and streams the
client abandons after five frames. Meanwhile each of ``--faults``, ``--repeat`` times, in turn:

- ``redis-pause``: SIGSTOP for ``--outage`` seconds, then SIGCONT (a hung Redis);
- ``redis-kill``: SIGKILL, down for ``--outage`` s, started again from its append-only file
  (synced every second: it may come back a second behind);
- ``redis-restart``: SIGTERM (the file synced), down for ``--outage`` s, started again;
- ``redis-flush``: ``FLUSHALL`` (budgets, leases, refund ids and the cache gone at once);
- ``gateway-kill``: a gateway replica SIGKILLs itself after writing down what it held (the usage
  it had not written yet, its settles, its renewers); Serve starts a replacement.

Then it settles (usage written, replicas idle, leases lapsed) and checks, ``--check`` exiting 1
if any claim fails:

1. **ledger = engines**: per pool, the ledger's prompt and completion tokens (delta over the
   run) equal the pool's engines' own counters (delta), no pool request was charged an
   estimate, and every request the clients sent is counted. A SIGKILLed gateway loses the
   requests in flight on it (never recorded) and any whose client saw it end whole an instant
   before the kill, its record not yet queued; what it held queued is in its usage journal,
   which its replacement writes (docs/operations.md, "Usage"; with ``metering.journal`` off it
   is lost too, at most ``metering.flush_s`` of its usage). The engines then lead the ledger by
   at most a prompt and ``max_tokens`` for each request lost (plus what it held, without the
   journal), and the never queued (plus the held) are at most the requests that ended in the
   ``flush_s`` before the kill (with the journal, in the half second before it). Without a
   gateway kill: equal.
2. **budgets held**: per tenant with a ``rpm``/``tpm`` budget and per fault window (the fault's
   start to ``--after`` seconds past its end), what was served (200s; their tokens) beyond what
   one token bucket allows over the window (burst + rate × length) is at most the documented
   bound (docs/operations.md, "The store and its failure modes"): each gateway replica's fresh
   local share (1 / gateway replicas of the burst) when the store fails, and the whole burst
   again when it comes back empty (a flush) or a second behind (a kill); nothing for a gateway
   kill or the calm before the first fault, unless a reserve failed in it. Tokens get the slack
   of the reservations settled across the window's edges (reserved ``prompt + max_tokens``,
   charged the real usage).
3. **nothing leaked**: no replica running, waiting or streaming; every pool's scheduler has no
   slot used, parked, in flight or queued; no live stream lease in Redis for any capped tenant
   (one a killed gateway held lapses by its TTL: waited for, and said) and the capped tenant sees
   its whole cap; in every live gateway replica no stream or slot lease still renewed, no settle
   pending or given up (every refund applied), no usage queued, no lease in its local share.

Writes ``<out>.json`` (config, faults, windows, claims, traffic) and ``<out>.md`` (the tables).
CI runs its quick form with ``--check`` (``scripts/doc_commands.py``), in a Ray of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx
import orjson

from loadtest import soak, traffic
from loadtest.soak import EMBED_MODEL, MODEL, Check, Extra, Fault, Graph
from loadtest.traffic import DROPPED, Result

# -- the graph -------------------------------------------------------------------------------

# The pools whose engines are the ground truth, by the model their ledger rows carry.
POOLS = {soak.PRIMARY: MODEL, "embed": EMBED_MODEL}
# Budgeted tenants that flood: 4 requests/s against 1/s (or against 60 tokens/s at 80 a
# request), bursts of 6 requests' worth, so a window's overshoot is a count of a few requests
# and a budget that doubled (a per-replica limit) shows at once.
FLOOD_LIMITS = {
    "rpm": {"rpm": 60, "burst_requests": 6},
    "tpm": {"tpm": 3600, "burst_tokens": 480},
}
FLOOD_RATE = 4.0
FLOOD_PROMPT, FLOOD_MAX = 48, 32  # a completion reserves exactly 80 tokens (no chat template)
# Beside the soak's temperature-0 repeats (16 prompts: a hit needs a minute of them), four
# prompts over and over, so that even the quick form's minute has its cache hits.
REPEAT_PROMPTS = 4
REPEATS = Extra("repeats", "interactive", "repeat", 0.5, max_tokens=16, prompt_tokens=32)


def flood_tenants(n: int) -> dict[str, dict]:
    """``n`` flooding tenants, requests/min and tokens/min bound in turn."""
    kinds = list(FLOOD_LIMITS)
    return {
        f"flood-{kinds[i % 2]}-{i // 2}": {"limits": dict(FLOOD_LIMITS[kinds[i % 2]])}
        for i in range(n)
    }


def floods(tenants: dict[str, dict]) -> list[Extra]:
    """The flooding tenants' traffic: non-streamed completions that never stop early, so what
    each reserves is what it is charged. Never scaled down (``--scale``): past its budget, a
    request costs the engines nothing."""
    return [
        Extra(f"flood:{name}", name, "flood", FLOOD_RATE, FLOOD_MAX, FLOOD_PROMPT)
        for name in tenants
    ]


@dataclass(frozen=True)
class EngineChoice:
    """Which engine serves the primary pool: the simulated one (the soak's), or a real vLLM
    (CPU build) on a model directory, one replica with configs/local-vllm.yaml's shape."""

    kind: str = "simulated"  # simulated | vllm
    model_path: str | None = None


def books_args(
    fallback_url: str,
    redis_url: str | None,
    *,
    extra_tenants: dict[str, dict],
    engine: EngineChoice,
) -> dict:
    """The soak's args (``soak.soak_args``) with the flooding tenants, the primary pool on the
    chosen engine."""
    args = soak.soak_args(fallback_url, redis_url)
    args["tenants"] += [
        {"name": name, "key_hashes": [soak._sha(soak.tenant_key(name))], **spec}
        for name, spec in extra_tenants.items()
    ]
    if engine.kind == "vllm":
        from serve_app.tools.tiny_model import vllm_engine_config

        primary = next(p for p in args["pools"] if p["name"] == soak.PRIMARY)
        primary["engine"] = vllm_engine_config(engine.model_path)
        primary["admission"] = {
            "max_inflight": 4,
            "queue_cap": 8,
            "deadline_s": 10,
            "max_tenant_share": 0.75,
        }
        primary["deployment"] = {
            "num_replicas": 1,
            "graceful_shutdown_timeout_s": 30,
            "ray_actor_options": {
                "num_cpus": 0,  # vLLM's engine-core process binds its own core
                "runtime_env": {"env_vars": {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}},
            },
        }
    return args


def tenant_configs(extra_tenants: dict[str, dict]) -> dict[str, dict]:
    """Every tenant of the drill's graph and its config (the soak's four and the floods)."""
    return {**soak.TENANTS, **extra_tenants}


def deploy(
    proxy_url: str,
    redis: soak.PersistentRedis,
    extra_tenants: dict[str, dict],
    engine: EngineChoice | None = None,
) -> Graph:
    """The soak's graph (``soak.deploy``) with these tenants and this engine (simulated)."""
    engine = engine or EngineChoice()
    return soak.deploy(
        proxy_url,
        redis,
        lambda fallback, url: books_args(fallback, url, extra_tenants=extra_tenants, engine=engine),
    )


# -- traffic ---------------------------------------------------------------------------------


async def _send(
    http: httpx.AsyncClient, extra: Extra, n: int, seed: int, began: float, timeout_s: float
) -> Result:
    """One request of an extra (``soak.run_extras``' sender): a flood's here, the rest the
    soak's. A budget's 429 is ``http_429:requests`` or ``http_429:tokens`` (OpenAI's error
    ``type``), apart from admission's ``http_429:capacity``."""
    if extra.kind == "repeat":  # the soak's cached kind, on fewer prompts
        cached = replace(extra, kind="cached")
        return await soak._send_extra(http, cached, n % REPEAT_PROMPTS, seed, began, timeout_s)
    if extra.kind != "flood":
        return await soak._send_extra(http, extra, n, seed, began, timeout_s)
    body = {
        "model": MODEL,
        "prompt": traffic.prompt_of(extra.prompt_tokens, f"{seed}:{extra.name}:{n}"),
        "max_tokens": extra.max_tokens,
        "ignore_eos": True,
    }
    headers = {
        "authorization": f"Bearer {soak.tenant_key(extra.tenant)}",
        "content-type": "application/json",
    }
    t0 = time.perf_counter()
    result = traffic._blank(extra.name, t0 - began)
    try:
        async with asyncio.timeout(timeout_s):
            r = await http.post("/v1/completions", content=orjson.dumps(body), headers=headers)
        result.status = r.status_code
        result.backend = r.headers.get("x-forge-backend")
        result.cache = r.headers.get("x-forge-cache")
        result.request_id = r.headers.get("x-request-id")
        if r.status_code == 200:
            usage = orjson.loads(r.content).get("usage") or {}
            result.prompt_tokens = usage.get("prompt_tokens")
            result.completion_tokens = usage.get("completion_tokens")
            result.ttft = time.perf_counter() - t0
        else:
            kind = None
            if r.status_code == 429:
                with contextlib.suppress(orjson.JSONDecodeError, AttributeError, KeyError):
                    kind = orjson.loads(r.content)["error"]["type"]
            result.error = f"http_{r.status_code}" + (f":{kind}" if kind else "")
    except (TimeoutError, httpx.TimeoutException):
        result.error = "timeout"
    except (httpx.HTTPError, OSError):
        result.error = "transport"
    except orjson.JSONDecodeError:
        result.error = "bad_json"
    result.total = time.perf_counter() - t0
    return result


async def _all_traffic(
    url: str, duration_s: float, seed: int, scale: float, flood: list[Extra], t0_path: str
) -> list[Result]:
    streams = [replace(s, rate=s.rate * scale) for s in soak.chat_streams()]
    extras = [replace(e, rate=e.rate * scale) for e in (*soak.EXTRAS, REPEATS)] + flood
    # The run's origin, for the driver's fault schedule: every runner's own starts here (ms).
    with open(t0_path, "w") as f:  # noqa: ASYNC230 (once, before any request)
        f.write(repr(time.time()))
    chat, more = await asyncio.gather(
        traffic.run(url, streams, duration_s, seed=seed, timeout_s=60.0),
        soak.run_extras(url, extras, duration_s, seed=seed, send=_send),
    )
    return sorted(chat + more, key=lambda r: r.start)


def _load_generator(
    url: str,
    duration_s: float,
    seed: int,
    scale: float,
    flood: list[Extra],
    out: str,
    t0_path: str,
) -> None:
    """The child process's body: all the traffic, then every result to ``out`` (JSON lines)."""
    results = asyncio.run(_all_traffic(url, duration_s, seed, scale, flood, t0_path))
    traffic.write_jsonl(results, Path(out))


def max_charge(results: Iterable[Result] = ()) -> tuple[int, int]:
    """The most prompt and completion tokens one request of the drill can be charged. A
    completion never passes its ``max_tokens``; a prompt's tokens are the engine's tokenizer's
    (vLLM's counts the same text as more than Forge's), so the bound is also the most any of
    ``results`` was charged, with a quarter's margin."""
    prompt, output = soak.max_charge()
    seen = max((r.prompt_tokens or 0 for r in results), default=0)
    return max(prompt, FLOOD_PROMPT, int(seen * 1.25)), max(output, FLOOD_MAX)


# -- faults ----------------------------------------------------------------------------------

FAULT_KINDS = ("gateway-kill", "redis-pause", "redis-kill", "redis-flush", "redis-restart")
OUTAGES = frozenset({"redis-pause", "redis-kill", "redis-restart"})  # Redis unreachable a while


def fault_plan(
    kinds: Sequence[str],
    repeat: int,
    duration_s: float,
    *,
    outage_s: float,
    after_s: float,
    lead_s: float,
) -> list[Fault]:
    """Every kind ``repeat`` times, in turn, evenly from ``lead_s`` (the calm before) to the
    last window's end ``after_s + 2`` before the traffic stops; each window (a fault's start to
    ``after_s`` past its end) over before the next fault starts."""
    order = [k for _ in range(repeat) for k in kinds]
    if not order:
        return []
    every = (duration_s - lead_s - after_s - 2 - outage_s) / len(order)
    if every < outage_s + after_s + 1:
        raise ValueError(
            f"{len(order)} faults in {duration_s:g} s leave {every:.1f} s each; a window needs "
            f"{outage_s + after_s + 1:g} s (--outage {outage_s:g} + --after {after_s:g} + 1): "
            "more --minutes or fewer --repeat"
        )
    return [
        Fault(round(lead_s + i * every, 1), kind, outage_s if kind in OUTAGES else 0.0)
        for i, kind in enumerate(order)
    ]


@dataclass
class KilledGateway:
    at_s: float
    replica: str
    held: dict  # what it held when it died (``gateway_state``'s fields)


class BooksInjector(soak.FaultInjector):
    """The soak's injector (its log and its Redis) with the drill's kinds."""

    def __init__(self, graph: Graph, admin: httpx.Client, workdir: Path) -> None:
        super().__init__(graph, admin)
        self.workdir = workdir
        self.origin = time.time()  # the run's origin (wall time); the drill sets it
        self.gateways_killed: list[KilledGateway] = []

    def start(self, fault: Fault, now_s: float) -> None:
        detail = getattr(self, f"_start_{fault.kind.replace('-', '_')}")(now_s)
        self.log.append({"t_s": round(now_s, 1), "event": f"{fault.kind} start", **detail})

    def end(self, fault: Fault, now_s: float) -> None:
        detail = getattr(self, f"_end_{fault.kind.replace('-', '_')}")()
        self.log.append({"t_s": round(now_s, 1), "event": f"{fault.kind} end", **detail})

    @property
    def redis(self) -> soak.PersistentRedis:
        assert self.graph.redis is not None
        return self.graph.redis

    def _start_redis_pause(self, now_s: float) -> dict:
        import signal

        self.redis.proc.send_signal(signal.SIGSTOP)
        return {"pid": self.redis.pid}

    def _end_redis_pause(self) -> dict:
        import signal

        self.redis.proc.send_signal(signal.SIGCONT)
        return {"pid": self.redis.pid}

    def _start_redis_kill(self, now_s: float) -> dict:
        proc = self.redis.proc
        proc.kill()
        proc.wait(20)
        self.redis.proc = None
        return {"pid": proc.pid}

    def _end_redis_kill(self) -> dict:
        self.redis.start()
        return {"pid": self.redis.pid, "keys": self.redis.client().dbsize()}

    # redis-restart: the soak's own (``_start_redis_restart``, ``_end_redis_restart``).

    def _start_redis_flush(self, now_s: float) -> dict:
        client = self.redis.client()
        keys = client.dbsize()
        client.flushall()
        return {"keys_flushed": keys}

    def _end_redis_flush(self) -> dict:
        return {}

    def _start_gateway_kill(self, now_s: float) -> dict:
        """The youngest gateway replica writes down what it holds and SIGKILLs itself, in one
        call on its event loop: nothing it serves can change in between."""
        import ray
        from ray.serve._private.constants import SERVE_NAMESPACE

        from serve_app.replica import admin as replica_admin

        ids = replica_admin.replica_ids(soak.APP, "gateway")
        actors = {
            r: ray.get_actor(f"SERVE_REPLICA::{soak.APP}#gateway#{r}", namespace=SERVE_NAMESPACE)
            for r in ids
        }
        pids = {
            r: ray.get(a.__ray_call__.remote(lambda _actor: os.getpid()), timeout=30)
            for r, a in actors.items()
        }
        victim = max(ids, key=lambda r: soak._create_time(pids[r]))
        path = self.workdir / f"gateway-{victim}-{now_s:.0f}.json"
        ref = actors[victim].__ray_call__.remote(_gateway_probe(), str(path))
        ray.wait([ref], timeout=30)
        with contextlib.suppress(Exception):  # it died answering: the point
            ray.get(ref, timeout=1)
        held = json.loads(path.read_text())
        at_s = held["at_wall"] - self.origin  # when it died, to the millisecond
        self.gateways_killed.append(KilledGateway(at_s, victim, held))
        return {
            "replica": victim,
            "died_at_s": round(at_s, 2),
            "pid": pids[victim],
            "usage_queued_requests": held["queued"].get("requests", 0),
            "settles_pending": held["settles_pending"],
            "contexts_alive": held["contexts_alive"],
        }

    def _end_gateway_kill(self) -> dict:
        return {}  # Serve starts the replacement: the window's reserve counts see it


# -- the gateways' own state -----------------------------------------------------------------


def _gateway_probe() -> Callable:
    """What a gateway replica holds that the books depend on, read in the replica (defined in
    here so that it is pickled by value: a replica cannot import the loadtest). With a path, the
    replica writes it there and SIGKILLs itself."""

    def probe(_actor, die_to: str | None = None) -> dict:
        import gc
        import json
        import os
        import signal
        import time

        from ray import serve

        from serve_app.stages.lease_keeper import LeaseKeeper
        from serve_app.stages.quota import QuotaStage

        gateway = serve.get_replica_context().servable_object
        lasting = gateway.lasting
        ledger = lasting.ledger
        entries = [(key, value) for key, value in ledger._pending.items()]
        if ledger._unconfirmed is not None:
            entries += [
                ((e.tenant, e.day, e.model, e.counter), e.value) for e in ledger._unconfirmed[1]
            ]
        queued: dict[str, int] = {}
        by_model: dict[str, dict[str, int]] = {}
        for (_tenant, _day, model, counter), value in entries:
            queued[counter] = queued.get(counter, 0) + value
            row = by_model.setdefault(model, {})
            row[counter] = row.get(counter, 0) + value
        # Leases still renewed: the quota stages' keepers (an old pipeline's too, until its
        # last request ends) and this replica's slots.
        lease_renewers = contexts = 0
        slot_renewers = sum(slots.kept_alive for slots in lasting.slots.values())
        for o in gc.get_objects():
            kind = type(o)
            if isinstance(o, LeaseKeeper):
                lease_renewers += o.kept
            elif kind.__name__ == "RequestContext" and kind.__module__ == "serve_app.pipeline":
                contexts += 1
        quota = gateway.pipeline.stage(QuotaStage)
        local = quota.local_store
        local_leases = {
            q.tenant: len(local._holders(q.stream_key, local._clock()))
            for q in quota.local_quotas.values()
            if q.max_streams is not None
        }
        state = {
            "at_wall": time.time(),
            "replica": serve.get_replica_context().replica_id.unique_id,
            "queued": queued,
            "queued_by_model": by_model,
            "queued_rows": ledger.queued,
            "settles_pending": lasting.settles.pending,
            "settles_given_up": lasting.settles.given_up,
            "lease_renewers": lease_renewers,
            "slot_renewers": slot_renewers,
            "local_leases": local_leases,
            # Request contexts alive (in flight, or not yet collected): evidence, not a claim.
            "contexts_alive": contexts,
            "store_errors": dict(gateway.metrics.store_errors_seen),
        }
        if die_to is not None:
            with open(die_to, "w") as f:
                json.dump(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return state

    return probe


def gateway_states() -> dict[str, dict]:
    """Every live gateway replica's ``_gateway_probe`` state, by replica id."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    from serve_app.replica import admin as replica_admin

    probe = _gateway_probe()
    out = {}
    for rid in replica_admin.replica_ids(soak.APP, "gateway"):
        actor = ray.get_actor(f"SERVE_REPLICA::{soak.APP}#gateway#{rid}", namespace=SERVE_NAMESPACE)
        with contextlib.suppress(Exception):  # one just killed may still be listed
            out[rid] = ray.get(actor.__ray_call__.remote(probe), timeout=60)
    return out


def reserve_errors() -> dict[str, int]:
    """Failed reserves counted by each live gateway replica so far, by replica id."""
    with contextlib.suppress(Exception):
        return {rid: ops.get("reserve", 0) for rid, ops in soak.gateway_store_errors()[0].items()}
    return {}


# -- the windows and the budgets -------------------------------------------------------------


@dataclass
class Window:
    """A stretch of the run the budgets are judged over: a fault and its recovery, or the calm
    before the first fault."""

    name: str
    kind: str  # a fault kind, or "calm"
    start_s: float
    end_s: float
    # Reserves the gateways counted as failed in it (None: a replica died, so unknown).
    reserve_failures: int | None = None


def windows_of(plan: Sequence[Fault], after_s: float, calm_from_s: float) -> list[Window]:
    seen: Counter[str] = Counter()
    out = []
    if plan and plan[0].at_s - 1 > calm_from_s:
        out.append(Window("calm", "calm", calm_from_s, plan[0].at_s - 1))
    for f in plan:
        seen[f.kind] += 1
        out.append(
            Window(f"{f.kind} #{seen[f.kind]}", f.kind, f.at_s, f.at_s + f.lasts_s + after_s)
        )
    return out


@dataclass(frozen=True)
class Limit:
    """One of a tenant's budgets: a token bucket of ``burst`` refilled at ``per_s``, and one
    gateway replica's local share of it while the store is unreachable."""

    tenant: str
    unit: str  # requests | tokens
    burst: float
    per_s: float
    share_burst: float


def budget_limits(tenants: dict[str, dict], gateways: int) -> list[Limit]:
    """Every rpm/tpm budget of these tenants, as the quota stage builds it (``TenantQuota``)."""
    from serve_app.config.models import TenantConfig
    from serve_app.stages.quota_buckets import TenantQuota

    out = []
    for name, spec in tenants.items():
        whole = TenantQuota.of(TenantConfig(name=name, **spec))
        share = TenantQuota.of(TenantConfig(name=name, **spec), share=1 / gateways)
        for unit, bucket, local in (
            ("requests", whole.requests, share.requests),
            ("tokens", whole.tokens, share.tokens),
        ):
            if bucket is not None:
                out.append(Limit(name, unit, bucket.capacity, bucket.refill_per_s, local.capacity))
    return out


def documented_extra(limit: Limit, window: Window, gateways: int) -> float:
    """What docs/operations.md lets a tenant be served beyond its budget in this window: every
    gateway replica's fresh local share when the store fails (an outage, or any reserve that
    failed in the window), and the whole burst again when it comes back empty or behind."""
    extra = 0.0
    if window.kind in OUTAGES or (window.reserve_failures or 0) > 0:
        extra += gateways * limit.share_burst
    if window.kind in ("redis-flush", "redis-kill"):
        extra += limit.burst
    return extra


# Admission happens a moment after the client's start: the window is judged a second longer.
TIMING_SLACK_S = 1.0


def _budget_refused(r: Result) -> bool:
    return r.error in ("http_429:requests", "http_429:tokens")


@dataclass(frozen=True)
class Shape:
    """What a stream's requests ask for: the prompt tokens (all inputs) and ``max_tokens``."""

    prompt_tokens: int
    max_tokens: int
    exact: bool = False  # a completion: the gateway reserves exactly prompt + max_tokens


def _reservation_gap(r: Result, shape: Shape) -> int:
    """How far a request's charge can be from what it reserved: exactly for a completion,
    else within the chat template's slack and the output it did not produce; a request not
    served gives back all it reserved."""
    reserved = shape.prompt_tokens + shape.max_tokens
    slack = 0 if shape.exact else soak.TEMPLATE_SLACK
    if r.status != 200:
        return reserved + slack
    used = (r.prompt_tokens or 0) + (r.completion_tokens or 0)
    if shape.exact:
        return abs(reserved - used)
    return slack + max(0, shape.max_tokens - (r.completion_tokens or 0))


@dataclass
class Overshoot:
    window: str
    kind: str
    tenant: str
    unit: str
    served: int
    budget: float
    slack: float
    bound: float
    reserve_failures: int | None

    @property
    def overshoot(self) -> float:
        return self.served - self.budget

    @property
    def ok(self) -> bool:
        return self.served <= self.budget + self.slack + self.bound + 1e-6


def overshoots(
    results: Sequence[Result],
    windows: Sequence[Window],
    limits: Sequence[Limit],
    gateways: int,
    stream_tenants: dict[str, str],
    shapes: dict[str, Shape],
) -> list[Overshoot]:
    """Per window and budget: what the tenant was served (200s started in the window; their
    tokens) against one bucket's allowance, the settle slack and the documented bound."""
    by_tenant: dict[str, list[Result]] = {}
    for r in results:
        if r.error != DROPPED and r.stream in stream_tenants:
            by_tenant.setdefault(stream_tenants[r.stream], []).append(r)
    out = []
    for w in windows:
        length = w.end_s - w.start_s + TIMING_SLACK_S
        for limit in limits:
            mine = by_tenant.get(limit.tenant, [])
            served = [r for r in mine if r.status == 200 and w.start_s <= r.start <= w.end_s]
            slack = 0.0
            if limit.unit == "tokens":
                amount = sum((r.prompt_tokens or 0) + (r.completion_tokens or 0) for r in served)
                edges = [
                    r
                    for r in mine
                    if not _budget_refused(r)
                    and any(r.start <= t <= r.start + r.total for t in (w.start_s, w.end_s))
                ]
                slack = float(sum(_reservation_gap(r, shapes[r.stream]) for r in edges))
            else:
                amount = len(served)
            out.append(
                Overshoot(
                    window=w.name,
                    kind=w.kind,
                    tenant=limit.tenant,
                    unit=limit.unit,
                    served=amount,
                    budget=limit.burst + limit.per_s * length,
                    slack=slack,
                    bound=documented_extra(limit, w, gateways),
                    reserve_failures=w.reserve_failures,
                )
            )
    return out


def check_budgets(rows: Sequence[Overshoot]) -> Check:
    over = [r for r in rows if not r.ok]
    worst = max(rows, key=lambda r: r.overshoot - r.bound - r.slack, default=None)
    detail = f"{len(rows)} (window, budget) pairs"
    if worst is not None:
        detail += (
            f"; closest to its bound: {worst.tenant} {worst.unit} in {worst.window}, served "
            f"{worst.served:,} vs budget {worst.budget:,.0f} (overshoot {worst.overshoot:+,.0f}, "
            f"bound {worst.bound:,.0f}, slack {worst.slack:,.0f})"
        )
    detail += "".join(
        f"; OVER: {r.tenant} {r.unit} in {r.window}: served {r.served:,}, budget "
        f"{r.budget:,.0f} + slack {r.slack:,.0f} + bound {r.bound:,.0f}"
        for r in over
    )
    return Check("budgets held through the outages", not over, detail)


# -- the ledger against the engines ----------------------------------------------------------


def ledger_by_model(admin: httpx.Client, days: tuple[dt.date, dt.date]) -> dict[str, dict]:
    """The usage report summed per model (every tenant), counters by name."""
    out: dict[str, Counter] = {}
    for row in soak.usage_rows(admin, days):
        errors = {f"errors_{name}": n for name, n in row.pop("errors").items()}
        totals = out.setdefault(row["model"], Counter())
        for name, value in {**row, **errors}.items():
            if isinstance(value, int):
                totals[name] += value
    return {model: dict(c) for model, c in out.items()}


def estimated_by_tenant(admin: httpx.Client, days: tuple[dt.date, dt.date]) -> dict[str, int]:
    """``estimated_requests`` per ``tenant/model``: where an estimate was charged, who paid."""
    return {
        f"{row['tenant']}/{row['model']}": row["estimated_requests"]
        for row in soak.usage_rows(admin, days)
        if row["estimated_requests"]
    }


def engine_counts() -> dict[str, dict]:
    """Each pool's engines' own counters, summed over its live replicas, and their ids."""
    from serve_app.replica import admin as replica_admin

    out = {}
    for pool in POOLS:
        stats = replica_admin.all_stats(soak.APP, f"pool-{pool}")
        out[pool] = {
            "prompt_tokens": sum(s["prompt_tokens"] for s in stats),
            "completion_tokens": sum(s["generation_tokens"] for s in stats),
            "replicas": sorted(s["replica"] for s in stats),
        }
    return out


def _delta(after: dict, before: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


BROKEN = ("transport", "timeout", "error_event", "no_done", "no_finish_reason", "bad_json")


def cut_by_kill(results: Sequence[Result], kill_s: float, after_s: float) -> list[Result]:
    """Requests a gateway kill broke: failed (a transport error, a 5xx, a stream cut short)
    while alive at the kill, or sent in the seconds after it (to the dead replica, before the
    proxy knew)."""
    return [
        r
        for r in results
        if r.error != DROPPED
        and (r.error in BROKEN or (r.error or "").startswith("http_5"))
        and r.start + r.total >= kill_s - 0.5
        and r.start <= kill_s + after_s
    ]


@dataclass
class LedgerBooks:
    """The numbers claim 1 is judged on."""

    pools: dict[str, dict]  # pool → ledger/engine prompt/completion deltas, estimated
    # tenant/model → requests charged an estimate (the run's: each run has a ledger file)
    estimated: dict[str, int]
    sent: int
    counted: int
    unanswered: int
    kills: list[dict]  # per gateway kill: held, cut, recent
    flush_s: float
    most_per_request: tuple[int, int]  # prompt, completion (``max_charge``)
    journal: bool = True  # a killed gateway's queued usage is written by another (not lost)


def ledger_books(
    ledger_before: dict,
    ledger_after: dict,
    engines_before: dict,
    engines_after: dict,
    results: Sequence[Result],
    killed: Sequence[KilledGateway],
    flush_s: float,
    after_s: float,
    estimated: dict[str, int] | None = None,
    *,
    journal: bool = True,
) -> LedgerBooks:
    pools = {}
    for pool, model in POOLS.items():
        led_a, led_b = ledger_after.get(model, {}), ledger_before.get(model, {})
        pools[pool] = {
            "model": model,
            "ledger_prompt": _delta(led_a, led_b, "prompt_tokens"),
            "ledger_completion": _delta(led_a, led_b, "completion_tokens"),
            "engine_prompt": _delta(engines_after[pool], engines_before[pool], "prompt_tokens"),
            "engine_completion": _delta(
                engines_after[pool], engines_before[pool], "completion_tokens"
            ),
            "estimated_requests": _delta(led_a, led_b, "estimated_requests"),
            "requests": _delta(led_a, led_b, "requests"),
            "replicas_same": engines_after[pool]["replicas"] == engines_before[pool]["replicas"],
        }
    counted = sum(
        _delta(ledger_after.get(m, {}), ledger_before.get(m, {}), "requests")
        for m in ledger_after.keys() | ledger_before.keys()
    )
    sent = [r for r in results if r.error != DROPPED]
    kills = []
    for k in killed:
        cut = cut_by_kill(sent, k.at_s, after_s)
        # Every client's requests that ended in the flush period before the kill: the most
        # the victim's unwritten records can be, by the docs.
        recent = sum(k.at_s - flush_s - 0.5 <= r.start + r.total <= k.at_s + 0.1 for r in sent)
        # And in the last half second: the most that can end whole and not be queued (a
        # record is queued, and journaled, within milliseconds of the response's end).
        instant = sum(k.at_s - 0.5 <= r.start + r.total <= k.at_s + 0.1 for r in sent)
        kills.append(
            {
                "at_s": round(k.at_s, 1),
                "replica": k.replica,
                "held": k.held,
                "cut": len(cut),
                "cut_by_error": dict(Counter(r.error for r in cut)),
                "recent": recent,
                "instant": instant,
            }
        )
    unanswered = sum(r.status == 0 for r in sent)
    return LedgerBooks(
        pools,
        estimated or {},
        len(sent),
        counted,
        unanswered,
        kills,
        flush_s,
        max_charge(sent),
        journal,
    )


def check_ledger(books: LedgerBooks) -> Check:
    """Claim 1 on ``books``. Without a gateway kill: every request counted (but one never
    answered), and the pools' tokens equal. With kills, what each killed replica lost: the
    requests cut on it, those whose client saw them end whole a moment before the kill but
    whose record was not yet queued, and (without a journal) the records it held, read at the
    kill; the first two at most a prompt and ``max_tokens`` each, and the never queued (plus
    the held) at most the requests that ended in the ``flush_s`` before the kill; with a
    journal, the never queued at most those that ended in the half second before it."""
    prompt_max, output_max = books.most_per_request
    held = {
        pool: {
            kind: sum(
                k["held"]["queued_by_model"].get(model, {}).get(f"{kind}_tokens", 0)
                for k in books.kills
            )
            for kind in ("prompt", "completion")
        }
        for pool, model in POOLS.items()
    }
    cut = sum(k["cut"] for k in books.kills)
    queued = sum(k["held"]["queued"].get("requests", 0) for k in books.kills)
    held_lost = 0 if books.journal else queued  # with a journal, what it held is written
    lost = books.sent - books.counted
    # Ended whole, never queued: the instant between a response's last byte and its record.
    unqueued = max(0, lost - books.unanswered - held_lost - cut)
    recent = sum(k["recent"] for k in books.kills)
    instant = sum(k.get("instant", k["recent"]) for k in books.kills)
    if books.kills:
        ok = 0 <= lost and held_lost + unqueued <= recent
        ok &= unqueued <= instant or not books.journal
    else:
        ok = 0 <= lost <= books.unanswered
    parts = []
    for pool, p in books.pools.items():
        for kind, most in (("prompt", prompt_max), ("completion", output_max)):
            gap = p[f"engine_{kind}"] - p[f"ledger_{kind}"]
            unwritten = 0 if books.journal else held[pool][kind]
            allowed = unwritten + (cut + unqueued) * most if books.kills else 0
            ok &= 0 <= gap <= allowed
            parts.append(
                f"{pool} {kind}: ledger {p[f'ledger_{kind}']:,} vs engines "
                f"{p[f'engine_{kind}']:,} (engines ahead by {gap:+,}; allowed 0..{allowed:,})"
            )
        ok &= p["estimated_requests"] == 0 and p["replicas_same"]
        who = {k: n for k, n in books.estimated.items() if k.endswith(f"/{p['model']}")}
        parts.append(f"{pool}: {p['estimated_requests']} charged an estimate {who or ''}".strip())
        if not p["replicas_same"]:
            parts.append(f"{pool}: a replica was replaced (its counters lost)")
    parts.append(
        f"requests: the clients sent {books.sent:,}, the ledger counts {books.counted:,} "
        f"({lost:,} missing: {books.unanswered} never answered, {held_lost} held unwritten by "
        f"killed gateways, {cut} cut by the kills, {unqueued} ended whole but never queued; "
        f"held + never queued {held_lost + unqueued} ≤ {recent} ended in the "
        f"{books.flush_s:g} s before a kill"
        + (f"; never queued ≤ {instant} ended in the 0.5 s before" if books.journal else "")
        + ")"
    )
    if books.kills and books.journal:
        parts.append(f"{queued} records the killed gateways held, written from their journals")
    parts += [
        f"gateway killed at {k['at_s']:.1f} s: {k['held']['queued'].get('requests', 0)} "
        f"records held, {k['recent']} requests ended in the {books.flush_s:g} s before, "
        f"{k['cut']} cut {k['cut_by_error']}"
        for k in books.kills
    ]
    return Check("ledger equals the engines' counters", ok, "; ".join(parts))


# -- leaks -----------------------------------------------------------------------------------


def capped_lease_keys(tenants: dict[str, dict]) -> dict[str, str]:
    """Each stream-capped tenant's lease key in Redis (``QuotaStage``, a sorted set)."""
    from serve_app.config.models import TenantConfig
    from serve_app.stages.quota_buckets import TenantQuota

    out = {}
    for name, spec in tenants.items():
        quota = TenantQuota.of(TenantConfig(name=name, **spec))
        if quota.max_streams is not None:
            out[name] = soak.KEY_PREFIX + quota.stream_key
    return out


def check_leases(redis: soak.PersistentRedis, tenants: dict[str, dict]) -> Check:
    from serve_app.stages.quota import LEASE_TTL_S

    keys = capped_lease_keys(tenants)

    def live() -> dict[str, int]:
        return {t: redis.live_leases(k) for t, k in keys.items()}

    first = live()
    left, waited = soak._wait_for(live, lambda n: not any(n.values()), LEASE_TTL_S + 15)
    return Check(
        "stream leases back to zero",
        not any(left.values()),
        f"live leases by tenant when first read {first}, {left} after {waited:.0f} s "
        f"(lease TTL {LEASE_TTL_S:g} s: a killed gateway's lapse by it)",
    )


def _gateways_clean(states: dict[str, dict]) -> bool:
    return bool(states) and all(
        s["settles_pending"] == 0
        and s["settles_given_up"] == 0
        and s["lease_renewers"] == 0
        and s["slot_renewers"] == 0
        and s["queued_rows"] == 0
        and not any(s["local_leases"].values())
        for s in states.values()
    )


def check_gateways(killed: Sequence[KilledGateway]) -> tuple[Check, dict[str, dict]]:
    """Every live gateway replica: no renewer, no settle pending or given up, no usage queued,
    no local lease. What killed replicas held is said (it died with them)."""
    states, waited = soak._wait_for(gateway_states, _gateways_clean, timeout_s=60)
    detail = "; ".join(
        f"{rid}: {s['lease_renewers']} stream / {s['slot_renewers']} slot leases renewed, "
        f"{s['settles_pending']} settles pending, {s['settles_given_up']} given up, "
        f"{s['queued_rows']} usage rows queued, local leases {s['local_leases']}"
        for rid, s in states.items()
    )
    died = sum(k.held["settles_pending"] for k in killed)
    detail += (
        f"; {waited:.0f} s after the leases; the {len(killed)} killed replicas took "
        f"{died} pending settles with them"
    )
    return Check("gateways hold nothing", _gateways_clean(states), detail), states


# -- the run ---------------------------------------------------------------------------------


@dataclass
class BooksReport(soak.Judged):
    duration_s: float
    gateways: int
    engine: str
    tenants: dict[str, dict]
    plan: list[dict]
    faults: list[dict]
    windows: list[Window]
    overshoots: list[Overshoot]
    ledger: LedgerBooks
    checks: list[Check]
    traffic: dict
    gateway_states: dict[str, dict]
    started_at: str
    checks_s: float
    results: list[Result]  # every request, for the evidence (``<out>-requests.jsonl``)


def _say(message: str) -> None:
    print(f"[books {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _drive(
    plan: Sequence[Fault],
    windows: list[Window],
    injector: BooksInjector,
    origin: float,
    duration_s: float,
    log: Callable[[str], None],
) -> None:
    """Each fault's start and end on time (``origin`` a wall time), and the gateways' failed
    reserves read at every window's edges; faults still on when interrupted are ended."""
    # At the same time: a window closes, a fault ends, a window opens, a fault starts (and a
    # fault that lasts no time ends).
    events: list[tuple[float, int, str, object]] = [(f.at_s, 3, "start", f) for f in plan]
    events += [(f.at_s + f.lasts_s, 1 if f.lasts_s else 4, "end", f) for f in plan]
    events += [(w.start_s, 2, "open", w) for w in windows]
    events += [(w.end_s, 0, "close", w) for w in windows]
    events.sort(key=lambda e: (e[0], e[1]))
    opened: dict[str, dict[str, int]] = {}
    try:
        while events:
            at, _, what, item = events[0]
            if (delay := origin + at - time.time()) > 0:
                time.sleep(min(delay, 1.0))
                continue
            events.pop(0)
            now = time.time() - origin
            if isinstance(item, Window):
                errors = reserve_errors()
                if what == "open":
                    opened[item.name] = errors
                elif errors:  # a replica killed in the window: its own count is lost with it
                    before = opened.pop(item.name, {})
                    item.reserve_failures = sum(n - before.get(r, 0) for r, n in errors.items())
                continue
            assert isinstance(item, Fault)
            try:
                (injector.start if what == "start" else injector.end)(item, now)
            except Exception as exc:  # a fault that could not be done is a finding too
                entry = {"t_s": round(now, 1), "event": f"{item.kind} {what}"}
                injector.log.append({**entry, "error": repr(exc)})
            log(f"t={now:5.1f}s {injector.log[-1]}")
        if (rest := origin + duration_s - time.time()) > 0:
            time.sleep(rest)
    finally:
        for _, _, what, item in events:
            if what == "end" and isinstance(item, Fault):
                with contextlib.suppress(Exception):
                    injector.end(item, time.time() - origin)


def _usage_settled(
    admin: httpx.Client, days: tuple[dt.date, dt.date], before: dict, expect: int
) -> tuple[dict, float]:
    """The ledger once it counts ``expect`` requests, or has stopped growing for 5 s (a
    killed gateway's records never come)."""
    began = time.monotonic()
    last, last_change = None, time.monotonic()
    while True:
        now = ledger_by_model(admin, days)
        total = sum(
            _delta(now.get(m, {}), before.get(m, {}), "requests") for m in now.keys() | before
        )
        if total != last:
            last, last_change = total, time.monotonic()
        if total >= expect or time.monotonic() - last_change >= 5 or time.monotonic() - began > 60:
            return now, time.monotonic() - began
        time.sleep(0.5)


def books(
    graph: Graph,
    duration_s: float,
    *,
    plan: Sequence[Fault],
    extra_tenants: dict[str, dict],
    workdir: Path,
    after_s: float,
    scale: float = 1.0,
    seed: int = 0,
    engine: str = "simulated",
    log: Callable[[str], None] = _say,
) -> BooksReport:
    """Drive ``graph`` for ``duration_s`` with ``plan``'s faults, let it settle, and judge the
    three claims."""
    from serve_app.config.models import MeteringConfig
    from serve_app.replica import admin as replica_admin

    if graph.redis is None:
        raise ValueError("the books drill needs Redis (redis-server): its faults are Redis's")
    began_wall = dt.datetime.now(dt.UTC)
    workdir.mkdir(parents=True, exist_ok=True)
    tenants = tenant_configs(extra_tenants)
    gateways = len(replica_admin.replica_ids(soak.APP, "gateway"))
    admin = httpx.Client(
        base_url=graph.url,
        headers={"authorization": f"Bearer {soak.ADMIN_KEY}"},
        timeout=30,
        trust_env=False,
    )

    def days() -> tuple[dt.date, dt.date]:
        return began_wall.date(), dt.datetime.now(dt.UTC).date()

    ledger_before, engines_before = ledger_by_model(admin, days()), engine_counts()
    injector = BooksInjector(graph, admin, workdir)
    windows = windows_of(plan, after_s, calm_from_s=3.0)
    flood = floods(extra_tenants)
    log(
        f"{duration_s:g} s against {graph.url} ({gateways} gateway replicas, {engine} engine); "
        "faults at " + ", ".join(f"{f.at_s:.0f} s {f.kind}" for f in plan)
    )
    results_path, t0_path = workdir / "books-requests.jsonl", workdir / "books-t0"
    t0_path.unlink(missing_ok=True)
    child = multiprocessing.get_context("spawn").Process(
        target=_load_generator,
        args=(graph.url, duration_s, seed, scale, flood, str(results_path), str(t0_path)),
        name="books-loadgen",
    )
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not t0_path.exists() or not t0_path.read_text():
            if time.monotonic() > deadline or not child.is_alive():
                raise RuntimeError("the load generator did not start")
            time.sleep(0.05)
        origin = injector.origin = float(t0_path.read_text())
        _drive(plan, windows, injector, origin, duration_s, log)
        child.join(timeout=180)
        if child.exitcode != 0:
            raise RuntimeError(f"the load generator exited with {child.exitcode}")
    finally:
        if child.is_alive():
            child.kill()
    traffic_ended = time.monotonic()
    results = traffic.read_jsonl(results_path)
    sent = sum(r.error != DROPPED for r in results)
    log(f"traffic done: {sent:,} requests sent; settling")

    _, waited = _usage_settled(admin, days(), ledger_before, sent)
    idle, _ = soak.check_replicas_idle()
    engines_after = engine_counts()
    ledger_after = ledger_by_model(admin, days())  # the records of the last aborts too
    flush_s, journal = MeteringConfig().flush_s, MeteringConfig().journal
    ledger = ledger_books(
        ledger_before,
        ledger_after,
        engines_before,
        engines_after,
        results,
        injector.gateways_killed,
        flush_s,
        after_s,
        estimated_by_tenant(admin, days()),
        journal=journal,
    )
    names = {s.name: s for s in soak.chat_streams()}
    extras = [*soak.EXTRAS, REPEATS, *flood]
    stream_tenants = {
        **{name: _tenant_of_key(s.key) for name, s in names.items()},
        **{e.name: e.tenant for e in extras},
    }
    shapes = {
        **{name: Shape(s.prompt_tokens, s.max_tokens) for name, s in names.items()},
        **{e.name: _shape(e) for e in extras},
    }
    limits = budget_limits(tenants, gateways)
    rows = overshoots(results, windows, limits, gateways, stream_tenants, shapes)
    checks = [check_ledger(ledger), check_budgets(rows), idle, soak.check_admission(admin)]
    checks.append(check_leases(graph.redis, tenants))
    gateway_check, states = check_gateways(injector.gateways_killed)
    checks += [gateway_check, soak.check_stream_cap(graph)]
    kinds = sorted({f.kind for f in plan})
    done = Counter(f["event"].removesuffix(" start") for f in injector.log if "start" in f["event"])
    failed = [f for f in injector.log if "error" in f]
    checks.append(
        Check(
            "every fault done",
            not failed and all(done[k] == sum(f.kind == k for f in plan) for k in kinds),
            ", ".join(f"{k} ×{done[k]}" for k in kinds)
            + "".join(f"; {f['event']}: {f['error']}" for f in failed),
        )
    )
    for c in checks:
        log(f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")

    stream_names = [*names, *(e.name for e in extras)]
    failures = [
        {k: v for k, v in asdict(r).items() if k not in ("ttft", "prompt_tokens", "cache")}
        for r in results
        if r.error not in (None, DROPPED) and not r.error.startswith("http_429")
    ]
    report = BooksReport(
        duration_s=duration_s,
        gateways=gateways,
        engine=engine,
        tenants=tenants,
        plan=[asdict(f) for f in plan],
        faults=injector.log,
        windows=windows,
        overshoots=rows,
        ledger=ledger,
        checks=checks,
        traffic={
            "streams": {n: traffic.summarize(results, n) for n in stream_names},
            "all": traffic.summarize(results),
            "cache_hits": sum(r.cache == "hit" for r in results),
            "abandoned": sum(r.stream == "abandon" and r.status == 200 for r in results),
            "failures": failures,
            "settle_s": round(waited, 1),
        },
        gateway_states=states,
        started_at=began_wall.isoformat(timespec="seconds"),
        checks_s=round(time.monotonic() - traffic_ended, 1),
        results=results,
    )
    admin.close()
    return report


def _tenant_of_key(key: str) -> str:
    return key.removeprefix("sk-soak-").removesuffix("-local-only")


def _shape(extra: Extra) -> Shape:
    inputs = soak.EMBED_INPUTS if extra.kind == "embedding" else 1
    exact = extra.kind in ("flood", "completion")
    return Shape(extra.prompt_tokens * inputs, extra.max_tokens, exact)


# -- outputs ---------------------------------------------------------------------------------


def write_outputs(report: BooksReport, out: Path, command: str) -> list[Path]:
    """``<out>.json``, ``<out>.md`` and ``<out>-requests.jsonl`` (every request as its client
    saw it); returns the paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".json"), out.with_suffix(".md")]
    paths.append(out.with_name(out.name + "-requests.jsonl"))
    traffic.write_jsonl(report.results, paths[2])
    data = {
        "command": command,
        "machine": soak._machine(),
        "started_at": report.started_at,
        "duration_s": report.duration_s,
        "engine": report.engine,
        "gateways": report.gateways,
        "ok": report.ok,
        "checks": [asdict(c) for c in report.checks],
        "tenants": report.tenants,
        "plan": report.plan,
        "faults": report.faults,
        "windows": [asdict(w) for w in report.windows],
        "overshoots": [
            {**asdict(o), "overshoot": round(o.overshoot, 1), "ok": o.ok} for o in report.overshoots
        ],
        "ledger": asdict(report.ledger),
        "gateway_states": report.gateway_states,
        "traffic": report.traffic,
        "checks_s": report.checks_s,
    }
    paths[0].write_text(json.dumps(data, indent=1))
    paths[1].write_text(markdown(report, command))
    return paths


def budget_table(rows: Sequence[Overshoot], tenants: Iterable[str]) -> list[str]:
    """The worst window of each fault kind, per judged tenant and budget."""
    chosen = set(tenants)
    worst: dict[tuple[str, str, str], Overshoot] = {}
    count: Counter[tuple[str, str, str]] = Counter()
    for r in rows:
        if r.tenant not in chosen:
            continue
        key = (r.kind, r.tenant, r.unit)
        count[key] += 1
        if key not in worst or r.overshoot - r.bound > worst[key].overshoot - worst[key].bound:
            worst[key] = r
    lines = [
        "| fault | windows | tenant | budget | worst window: served | one bucket's allowance "
        "| overshoot | documented bound (+ settle slack) | held |",
        "|---|---:|---|---|---:|---:|---:|---:|---|",
    ]
    held = {key: all(o.ok for o in rows if (o.kind, o.tenant, o.unit) == key) for key in worst}
    for key, r in sorted(worst.items()):
        slack = f" (+{r.slack:,.0f})" if r.slack else ""
        lines.append(
            f"| {key[0]} | {count[key]} | {key[1]} | {key[2]} | {r.served:,} | "
            f"{r.budget:,.0f} | {r.overshoot:+,.0f} | {r.bound:,.0f}{slack} | "
            f"{'yes' if held[key] else '**no**'} |"
        )
    return lines


def ledger_table(books: LedgerBooks) -> list[str]:
    lines = [
        "| pool | kind | ledger | engines | engines ahead | estimated |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for pool, p in books.pools.items():
        for kind in ("prompt", "completion"):
            gap = p[f"engine_{kind}"] - p[f"ledger_{kind}"]
            lines.append(
                f"| {pool} | {kind} | {p[f'ledger_{kind}']:,} | {p[f'engine_{kind}']:,} | "
                f"{gap:+,} | {p['estimated_requests']} |"
            )
    return lines


def markdown(report: BooksReport, command: str) -> str:
    floods_ = [t for t in report.tenants if t.startswith("flood-")]
    t = report.traffic
    lines = [
        f"# The books drill, {report.duration_s:g} s ({report.started_at})",
        "",
        f"`{command}` on {soak._machine()}; {report.engine} engine, {report.gateways} gateway "
        f"replicas. {t['all']['requests']:,} requests ({t['cache_hits']:,} cache hits, "
        f"{t['abandoned']:,} streams abandoned), settled {t['settle_s']:g} s after the traffic, "
        f"checks {report.checks_s:g} s.",
        "",
        "## Claims",
        "",
        "| claim | result | detail |",
        "|---|---|---|",
        *(f"| {c.name} | {'ok' if c.ok else '**FAIL**'} | {c.detail} |" for c in report.checks),
        "",
        "## The ledger against the engines (deltas over the run)",
        "",
        *ledger_table(report.ledger),
        "",
        "## Budgets: the worst window of each fault",
        "",
        *budget_table(report.overshoots, [*floods_, "limited"]),
        "",
        "## Faults",
        "",
        "| t, s | event | detail |",
        "|---:|---|---|",
        *(
            f"| {f['t_s']:.1f} | {f['event']} | "
            + ", ".join(f"{k} {v}" for k, v in f.items() if k not in ("t_s", "event"))
            + " |"
            for f in report.faults
        ),
        "",
        *soak._failures_lines(t["failures"], report.faults),
    ]
    return "\n".join(lines)


# -- the CLI ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=4.0, help="of traffic")
    parser.add_argument("--repeat", type=int, default=3, help="times each fault is done")
    parser.add_argument("--faults", nargs="+", choices=FAULT_KINDS, default=list(FAULT_KINDS))
    parser.add_argument("--outage", type=float, default=6.0, help="seconds Redis stays down")
    parser.add_argument("--after", type=float, default=5.0, help="seconds judged past a fault")
    parser.add_argument("--tenants", type=int, default=2, help="budgeted tenants that flood")
    parser.add_argument("--scale", type=float, default=None, help="the soak traffic's rates ×")
    parser.add_argument("--engine", choices=("simulated", "vllm"), default="simulated")
    parser.add_argument("--model", help="the model directory (--engine vllm)")
    parser.add_argument(
        "--quick", action="store_true", help="CI: 1 min, each fault once, 3 s outages (over all)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/books"))
    parser.add_argument("--check", action="store_true", help="exit 1 if a claim fails")
    args = parser.parse_args(argv)
    command = "python -m loadtest.books " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.quick:
        args.minutes, args.repeat, args.outage, args.after = 1.0, 1, 3.0, 4.0
    if args.engine == "vllm" and not args.model:
        parser.error(
            "--engine vllm needs --model (a directory: python -m serve_app.tools.tiny_model)"
        )
    if not shutil.which("redis-server"):
        parser.error("the books drill needs redis-server (its faults are Redis's)")
    scale = args.scale if args.scale is not None else (0.3 if args.engine == "vllm" else 1.0)
    duration_s = args.minutes * 60
    plan = fault_plan(
        args.faults,
        args.repeat,
        duration_s,
        outage_s=args.outage,
        after_s=args.after,
        lead_s=8.0,
    )

    import ray

    redis = soak.PersistentRedis()
    extra_tenants = flood_tenants(args.tenants)
    try:
        redis.start()
        proxy = soak.start_ray(dashboard=False)
        graph = deploy(proxy, redis, extra_tenants, EngineChoice(args.engine, args.model))
        with tempfile.TemporaryDirectory(prefix="forge-books-") as workdir:
            report = books(
                graph,
                duration_s,
                plan=plan,
                extra_tenants=extra_tenants,
                workdir=Path(workdir),
                after_s=args.after,
                scale=scale,
                seed=args.seed,
                engine=args.engine,
            )
        for path in write_outputs(report, args.out, command):
            _say(f"wrote {path}")
    finally:
        ray.shutdown()
        redis.close()
    if not report.ok:
        _say("FAILED: " + "; ".join(c.name for c in report.failed()))
        return 1 if args.check else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
