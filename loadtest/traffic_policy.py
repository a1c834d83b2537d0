"""Traffic-policy drill: aliases, a weighted canary, a fallback chain and shadow traffic on the
laptop graph, as an operator runs them.

``serve run`` of a copy of configs/local.yaml with three more simulated pools, each in its own
application (``canary``: the primary's next version; ``small``: a faster, smaller model;
``long``: a 32k-context one), fifty drill tenants and these ``models:`` entries in the gateway's
``user_config`` (live):

- ``chat``: 90 % primary (stable), 10 % canary, sticky per conversation, 10 % shadowed to small,
  with an analysis that aborts a faulty canary; ``chat-tenant``: the same split, per tenant;
- ``big``: primary, spilling to small when primary has no free slot, then the fallback;
  ``big-alone``: primary and nothing else (the comparison);
- ``long``: primary (a 2,048-token window), and the long pool for prompts that do not fit.

Phases, in this order, all through :8000: **split** (``--requests`` conversations of one turn:
the canary's share), **sticky** (each of 50 tenants, and of 300 conversations over three turns,
on one variant), **live** (``serve deploy`` of 50/50: how soon the new split is served, and which
replicas were replaced), **overload** (the same open-loop flood at ``big-alone``, then at
``big``: 429s and p95), **down** (primary and small failing: ``big`` served by the fallback),
**context** (a 3,000-token prompt to ``long``), **shadow** (a tenant's usage against the sum of
its answers, while copies ran), **canary** (``python -m evals canary`` on a healthy canary, then
on one whose replica fails every request: promote, then abort, its weight 0 by the gateway).

    python -m loadtest.traffic_policy [--requests 10000] [--check]

Writes ``loadtest/results/traffic-policy.json`` and ``docs/img/traffic-policy.png``; ``--check``
exits 1 unless every expectation held (the module's ``problems``).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import yaml

from evals import canary as canary_analysis
from evals.profile import Profile
from evals.target import Target
from loadtest.local_graph import (
    ADMIN_KEY,
    CONFIG,
    LOCAL_URL,
    REPO,
    port_answers,
    start_graph,
    stop_graph,
    wait_ready,
)
from loadtest.rollout import Cluster, compare, settled, wait_for
from loadtest.traffic import prompt_of
from serve_app.auth.keys import hash_key

TENANTS = 50
SHADOW_KEY = "sk-drill-traffic-shadow-local-only"
LOAD_KEY = "sk-drill-traffic-load-local-only"  # a tenant with no budgets: the drill's own load
CANARY_WEIGHT = 10.0
RAISED_WEIGHT = 50.0
CHAT_ANALYSIS = {
    "canary": "canary",
    "stable": "stable",
    "window_s": 60,
    "min_requests": 20,
    "max_error_ratio_increase": 0.05,
    "max_ttft_ratio": 2.0,
}
# The analysis' operating point: the canary's 10 % of 15 req/s for 20 s is ~30 requests, past
# min_requests (20) nearly always; each request its own prompt, so its own conversation.
ANALYSIS_PROFILE = {
    "name": "traffic-policy",
    "operating_point": {
        "duration_s": 20,
        "warmup_s": 0,
        "streams": [{"name": "chat", "rate": 15, "prompt_tokens": 256, "max_tokens": 32}],
    },
    "slo": {"ttft_p95_s": 1.0, "tpot_p95_s": 0.1},
}


def tenant_key(i: int) -> str:
    return f"sk-drill-traffic-{i}-local-only"


def split(weight: float, sticky: str, **extra) -> dict:
    return {
        "variants": [
            {"name": "stable", "pool": "primary", "weight": 100.0 - weight},
            {"name": "canary", "pool": "canary", "weight": weight},
        ],
        "sticky": sticky,
        "chain": [{"pool": "fallback", "when": ["breaker_open", "error"]}],
        **extra,
    }


def models(weight: float) -> list[dict]:
    return [
        {
            "name": "chat",
            **split(weight, "conversation"),
            "shadow": {"pool": "small", "percent": 10},
            "analysis": CHAT_ANALYSIS,
        },
        {"name": "chat-tenant", **split(weight, "tenant")},
        {
            "name": "big",
            "variants": [{"name": "main", "pool": "primary"}],
            "chain": [
                {"pool": "small", "when": ["overload", "breaker_open"]},
                {"pool": "fallback", "when": ["overload", "breaker_open", "error"]},
            ],
        },
        {"name": "big-alone", "variants": [{"name": "main", "pool": "primary"}], "chain": []},
        {
            "name": "long",
            "variants": [{"name": "main", "pool": "primary"}],
            "chain": [{"pool": "long", "when": ["context_length"]}],
        },
    ]


def serve_config(weight: float = CANARY_WEIGHT) -> dict:
    """configs/local.yaml with the drill's pools, tenants and models: entries."""
    config = yaml.safe_load((REPO / CONFIG).read_text())
    apps = {a["name"]: a for a in config["applications"]}
    gateway, primary_app = apps["forge"], apps["forge-pool-primary"]
    primary = next(p for p in gateway["args"]["pools"] if p["name"] == "primary")
    primary["context_window"] = 2048
    shared = {k: v for k, v in primary.items() if k not in ("app", "admission", "context_window")}
    extra = {
        "canary": ("forge-sim-1b-v2", {}),
        # A smaller model: a quicker step, shorter answers.
        "small": (
            "forge-sim-small",
            {
                "decode_base_s": 0.004,
                "decode_per_seq_s": 0.0001,
                "prefill_per_token_s": 0.00003,
                "max_num_seqs": 32,
            },
        ),
        "long": ("forge-sim-long", {"max_model_len": 32768}),
    }
    for name, (model, engine) in extra.items():
        entry = {**shared, "name": name, "model": model, "app": f"forge-pool-{name}"}
        gateway["args"]["pools"].append(entry)
        app = copy.deepcopy(primary_app)
        app["name"] = f"forge-pool-{name}"
        pool = app["args"]["pool"]
        pool.update({k: v for k, v in entry.items() if k != "app"})
        pool["engine"] = {**pool["engine"], **engine}
        pool["deployment"]["num_replicas"] = 2 if name == "small" else 1
        pool["deployment"]["max_ongoing_requests"] = 2 * pool["engine"]["max_num_seqs"]
        config["applications"].append(app)
    user_config = gateway["deployments"][0]["user_config"]
    user_config["tenants"] += [
        {"name": f"drill-{i}", "key_hashes": [hash_key(tenant_key(i))]} for i in range(TENANTS)
    ]
    for name, key in (("drill-shadow", SHADOW_KEY), ("drill-load", LOAD_KEY)):
        user_config["tenants"].append({"name": name, "key_hashes": [hash_key(key)]})
    user_config["models"] = models(weight)
    gateway["args"]["cache"] = {**gateway["args"]["cache"], "enabled": False}
    return config


# -- traffic ---------------------------------------------------------------------------------


def chat(model: str, messages: list[dict], max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream}


def turn(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


async def send(http: httpx.AsyncClient, body: dict, key: str = LOAD_KEY) -> dict:
    started = time.perf_counter()
    try:
        response = await http.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )
    except httpx.HTTPError as exc:
        return {"status": 0, "error": type(exc).__name__, "s": time.perf_counter() - started}
    usage = response.json().get("usage") if response.status_code == 200 else None
    return {
        "status": response.status_code,
        "variant": response.headers.get("x-forge-variant"),
        "backend": response.headers.get("x-forge-backend"),
        "usage": usage,
        "s": time.perf_counter() - started,
    }


async def many(http: httpx.AsyncClient, jobs: list[tuple[dict, str]], concurrency: int) -> list:
    queue = list(enumerate(jobs))
    results: list = [None] * len(jobs)

    async def worker() -> None:
        while queue:
            i, (body, key) = queue.pop()
            results[i] = await send(http, body, key)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def share(results: list[dict], variant: str) -> float:
    """Of the requests a variant was drawn for (errors say theirs too)."""
    drawn = [r for r in results if r.get("variant")]
    return sum(r["variant"] == variant for r in drawn) / max(1, len(drawn))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def admin(method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    return httpx.request(method, f"{LOCAL_URL}{path}", headers=headers, timeout=30, **kwargs)


def fault(pool: str, mode: str) -> None:
    admin("POST", "/admin/faults", json={"pool": pool, "fault": {"mode": mode}}).raise_for_status()


def reset_breakers() -> None:
    admin("POST", "/admin/breakers/reset", json={})


# -- phases ----------------------------------------------------------------------------------


async def phase_split(http: httpx.AsyncClient, requests: int) -> dict:
    """One-turn conversations, their openings fixed (``conversation 0`` ...): the same keys,
    so the same split, every run; the keys' hashes are what spread them."""
    jobs = [(chat("chat", turn(f"conversation {i}"), 1), LOAD_KEY) for i in range(requests)]
    started = time.perf_counter()
    # 12: the most of the primary's 16 slots one tenant may hold (max_tenant_share 0.75).
    results = await many(http, jobs, 12)
    took = time.perf_counter() - started
    served = [r for r in results if r["status"] == 200]
    own_pool = sum(
        r["backend"] == {"stable": "primary", "canary": "canary"}[r["variant"]] for r in served
    )
    return {
        "requests": requests,
        "served": len(served),
        "errors": len(results) - len(served),
        "canary_share": share(results, "canary"),
        "weight": CANARY_WEIGHT / 100,
        "answered_by_own_pool": own_pool,
        "req_per_s": round(requests / took, 1),
    }


async def phase_sticky(http: httpx.AsyncClient) -> dict:
    per_tenant = await many(
        http,
        [
            (chat("chat-tenant", turn(f"q{j}")), tenant_key(i))
            for i in range(TENANTS)
            for j in range(10)
        ],
        16,
    )
    tenants: dict[int, set] = {}
    for n, result in enumerate(per_tenant):
        tenants.setdefault(n // 10, set()).add(result["variant"])
    conversations: dict[int, set] = {}
    gate = asyncio.Semaphore(12)

    async def conversation(i: int) -> None:
        opening = {"role": "user", "content": f"story {i}: {uuid.uuid4().hex}"}
        history = [{"role": "system", "content": "You are terse."}, opening]
        async with gate:
            for _ in range(3):
                result = await send(http, chat("chat", history))
                conversations.setdefault(i, set()).add(result["variant"])
                more = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
                history = [*history, *more]

    await asyncio.gather(*(conversation(i) for i in range(300)))
    return {
        "tenants": TENANTS,
        "tenants_on_one_variant": sum(len(v) == 1 and None not in v for v in tenants.values()),
        "tenants_on_canary": sum(v == {"canary"} for v in tenants.values()),
        "conversations": 300,
        "conversations_on_one_variant": sum(
            len(v) == 1 and None not in v for v in conversations.values()
        ),
    }


async def phase_live(http: httpx.AsyncClient, cluster: Cluster, workdir: Path) -> dict:
    path = workdir / "raised.yaml"
    path.write_text(yaml.safe_dump(serve_config(RAISED_WEIGHT), sort_keys=False))
    probe = [(chat("chat", turn(f"probe {i}"), 1), LOAD_KEY) for i in range(200)]
    before_share = share(await many(http, probe, 12), "canary")
    replicas = cluster.replicas()
    started = time.perf_counter()
    deploy_s = cluster.deploy(path)
    served_in_s = None
    while time.perf_counter() - started < 60:
        now = share(await many(http, probe, 12), "canary")
        if abs(now - RAISED_WEIGHT / 100) <= 0.1:
            served_in_s = time.perf_counter() - started
            break
    wait_for(lambda: settled(cluster.replicas()), 60)
    replaced, _ = compare(replicas, cluster.replicas())
    after = await many(
        http,
        [(chat("chat", turn(f"after {i}"), 1), LOAD_KEY) for i in range(2000)],
        12,
    )
    return {
        "probe_share_before": before_share,
        "deploy_s": round(deploy_s, 2),
        "served_in_s": None if served_in_s is None else round(served_in_s, 2),
        "replaced": {k: v for k, v in replaced.items() if v},
        "canary_share_after": share(after, "canary"),
        "weight_after": RAISED_WEIGHT / 100,
    }


async def flood(http: httpx.AsyncClient, model: str, rate: float, seconds: float) -> dict:
    """Open loop: ``rate`` arrivals a second for ``seconds`` (evenly spaced), each a 48-token
    answer; 429s are answered at once and do not come back sooner (unlike a closed loop)."""
    tasks = []
    started = time.perf_counter()
    for n in range(int(rate * seconds)):
        await asyncio.sleep(max(0.0, started + n / rate - time.perf_counter()))
        body = chat(model, turn(f"flood {n} {uuid.uuid4().hex}"), 48)
        tasks.append(asyncio.ensure_future(send(http, body)))
    results = await asyncio.gather(*tasks)
    ok = [r for r in results if r["status"] == 200]
    return {
        "requests": len(results),
        "429": sum(r["status"] == 429 for r in results),
        "other_errors": sum(r["status"] not in (200, 429) for r in results),
        "p50_s": pct([r["s"] for r in ok], 0.5),
        "p95_s": pct([r["s"] for r in ok], 0.95),
        "backends": dict(Counter(r["backend"] for r in ok)),
        "latencies_s": sorted(round(r["s"], 4) for r in ok),
    }


async def phase_overload(http: httpx.AsyncClient, rate: float) -> dict:
    """The same flood at the pool alone, then at the chain; a pause between for the queues."""
    alone = await flood(http, "big-alone", rate, 15)
    await asyncio.sleep(3)
    chained = await flood(http, "big", rate, 15)
    return {"rate": rate, "big-alone": alone, "big": chained}


async def phase_down(http: httpx.AsyncClient) -> dict:
    fault("primary", "error")
    fault("small", "error")
    try:
        results = await many(
            http, [(chat("big", turn(f"down {i}")), LOAD_KEY) for i in range(60)], 4
        )
    finally:
        fault("primary", "none")
        fault("small", "none")
        reset_breakers()
    return {
        "requests": len(results),
        "errors": sum(r["status"] != 200 for r in results),
        "backends": dict(Counter(r["backend"] for r in results)),
    }


async def phase_context(http: httpx.AsyncClient) -> dict:
    long_prompt = await send(http, chat("long", turn(prompt_of(3000)), 8))
    short_prompt = await send(http, chat("long", turn("short"), 8))
    return {
        "long_prompt_backend": long_prompt["backend"],
        "long_prompt_status": long_prompt["status"],
        "short_prompt_backend": short_prompt["backend"],
    }


def tenant_tokens(tenant: str) -> int:
    rows = admin("GET", "/admin/usage", params={"tenant": tenant}).json().get("data", [])
    return sum(r.get("prompt_tokens", 0) + r.get("completion_tokens", 0) for r in rows)


async def phase_shadow(http: httpx.AsyncClient) -> dict:
    before = admin("GET", "/admin/status").json().get("shadow", {})
    charged_before = tenant_tokens("drill-shadow")  # the laptop's ledger outlives a run
    results = await many(
        http, [(chat("chat", turn(f"shadowed {i}"), 8), SHADOW_KEY) for i in range(300)], 8
    )
    answered = sum(
        r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in results if r["usage"]
    )
    wait_for(lambda: tenant_tokens("drill-shadow") - charged_before >= answered, 20)
    await asyncio.sleep(2)  # a copy charged by mistake would land within the flush
    after = admin("GET", "/admin/status").json().get("shadow", {})
    copies = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    return {
        "requests": len(results),
        "errors": sum(r["status"] != 200 for r in results),
        "answers_tokens": answered,
        "charged_tokens": tenant_tokens("drill-shadow") - charged_before,
        "copies": copies,
    }


async def phase_canary() -> dict:
    target = Target(
        base_url=LOCAL_URL,
        key=LOAD_KEY,
        profile=Profile.model_validate(ANALYSIS_PROFILE),
        admin_key=ADMIN_KEY,
    )
    profile = target.profile
    healthy, healthy_lines = await canary_analysis.analyse(target, "chat", profile)
    fault("canary", "error")
    try:
        faulty, faulty_lines = await canary_analysis.analyse(target, "chat", profile)
        entry = await canary_analysis.entry_status(target, "chat")
    finally:
        fault("canary", "none")
    return {
        "healthy": healthy,
        "healthy_report": healthy_lines,
        "faulty": faulty,
        "faulty_report": faulty_lines,
        "weights_after_abort": entry["weights"],
        "aborted": entry["aborted"],
    }


async def drill(requests: int, rate: float, workdir: Path) -> dict:
    cluster = Cluster()
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=LOCAL_URL, timeout=120, limits=limits) as http:
        out = {"split": await phase_split(http, requests)}
        print("split", out["split"], flush=True)
        out["sticky"] = await phase_sticky(http)
        print("sticky", out["sticky"], flush=True)
        out["live"] = await phase_live(http, cluster, workdir)
        print("live", out["live"], flush=True)
        out["overload"] = await phase_overload(http, rate)
        overload = {
            name: {k: v for k, v in flood.items() if k != "latencies_s"}
            for name, flood in out["overload"].items()
            if isinstance(flood, dict)
        }
        print("overload", overload, flush=True)
        out["down"] = await phase_down(http)
        out["context"] = await phase_context(http)
        out["shadow"] = await phase_shadow(http)
        print("down/context/shadow", out["down"], out["context"], out["shadow"], flush=True)
        out["canary"] = await phase_canary()
        print("canary", out["canary"]["healthy"], out["canary"]["faulty"], flush=True)
    return out


def problems(out: dict) -> list[str]:
    found = []
    s = out["split"]
    if s["errors"] or abs(s["canary_share"] - s["weight"]) > 0.02:
        found.append(
            f"split: canary share {s['canary_share']:.3f} vs {s['weight']}, {s['errors']} errors"
        )
    if s["answered_by_own_pool"] != s["served"]:
        found.append("split: a variant was answered by another pool")
    st = out["sticky"]
    if (
        st["tenants_on_one_variant"] != st["tenants"]
        or st["conversations_on_one_variant"] != st["conversations"]
    ):
        found.append(f"sticky: {st}")
    live = out["live"]
    if (
        live["served_in_s"] is None
        or live["replaced"]
        or abs(live["canary_share_after"] - live["weight_after"]) > 0.04
    ):
        found.append(f"live: {live}")
    o = out["overload"]
    if not (
        o["big"]["429"] < o["big-alone"]["429"]
        and (o["big"]["p95_s"] or 0) < (o["big-alone"]["p95_s"] or 0)
    ):
        brief = {
            k: {m: v for m, v in f.items() if m != "latencies_s"}
            for k, f in o.items()
            if isinstance(f, dict)
        }
        found.append(f"overload: the chain did not cut 429s and p95: {brief}")
    if not o["big"]["backends"].get("small"):
        found.append("overload: nothing spilled to small")
    d = out["down"]
    if d["errors"] or set(d["backends"]) != {"fallback"}:
        found.append(f"down: {d}")
    c = out["context"]
    if c["long_prompt_backend"] != "long" or c["short_prompt_backend"] != "primary":
        found.append(f"context: {c}")
    sh = out["shadow"]
    if (
        sh["errors"]
        or sh["charged_tokens"] != sh["answers_tokens"]
        or not any(k.endswith("/ok") for k in sh["copies"])
    ):
        found.append(f"shadow: {sh}")
    can = out["canary"]
    if can["healthy"] != "promote" or can["faulty"] != "abort" or can["aborted"] != ["canary"]:
        found.append(
            f"canary: healthy {can['healthy']}, faulty {can['faulty']}, aborted {can['aborted']}"
        )
    return found


def markdown(out: dict) -> str:
    s, st, live, o, d, c, sh, can = (
        out[k]
        for k in ("split", "sticky", "live", "overload", "down", "context", "shadow", "canary")
    )
    alone, big = o["big-alone"], o["big"]

    def ms(x):
        return "n/a" if x is None else f"{x * 1000:.0f} ms"

    rows = [
        (
            "split",
            f"{s['requests']:,} conversations at 90/10: canary {s['canary_share']:.1%} "
            f"(±2 % wanted), {s['errors']} errors, every answer from its variant's pool",
        ),
        (
            "sticky",
            f"{st['tenants_on_one_variant']}/{st['tenants']} tenants and "
            f"{st['conversations_on_one_variant']}/{st['conversations']} three-turn conversations "
            "on one variant",
        ),
        (
            "live 10 → 50",
            f"`serve deploy` {live['deploy_s']} s, new split served {live['served_in_s']} s "
            f"after it began; canary {live['canary_share_after']:.1%} of the next 2,000; "
            f"replicas replaced: {live['replaced'] or 'none'}",
        ),
        (
            "overload",
            f"{o['rate']:g} req/s open loop, 15 s each: big-alone {alone['429']} × 429 of "
            f"{alone['requests']}, p95 {ms(alone['p95_s'])}; big (chain) {big['429']} × 429 of "
            f"{big['requests']}, p95 {ms(big['p95_s'])}, served by {big['backends']}",
        ),
        (
            "both down",
            f"primary and small failing: {d['requests']} requests, {d['errors']} errors, "
            f"served by {d['backends']}",
        ),
        (
            "context",
            f"3,000-token prompt → {c['long_prompt_backend']}; a short one → "
            f"{c['short_prompt_backend']}",
        ),
        (
            "shadow",
            f"{sh['requests']} requests, copies {sh['copies']}; tenant charged "
            f"{sh['charged_tokens']} tokens, its answers' usage {sh['answers_tokens']}",
        ),
        (
            "canary analysis",
            f"healthy: {can['healthy']}; canary failing every request: "
            f"{can['faulty']}, weights by the gateway {can['weights_after_abort']}",
        ),
    ]
    lines = ["| phase | result |", "|---|---|"]
    lines += [f"| {name} | {text} |" for name, text in rows]
    return "\n".join(lines)


def plot(out: dict, path: Path) -> None:
    """The split against its weights, and the overload phase's served latencies (CDF)."""
    from loadtest import plots

    fig, (split_ax, cdf_ax) = plots.subplots(1, 2, figsize=(10, 3.6))
    labels = ["split 90/10", "after 10 → 50"]
    wanted = [out["split"]["weight"], out["live"]["weight_after"]]
    measured = [out["split"]["canary_share"], out["live"]["canary_share_after"]]
    xs = range(len(labels))
    split_ax.bar([x - 0.2 for x in xs], wanted, 0.4, label="weight")
    split_ax.bar([x + 0.2 for x in xs], measured, 0.4, label="served")
    split_ax.set_xticks(list(xs), labels)
    split_ax.set_ylabel("canary share")
    split_ax.legend()
    for name, label in (("big-alone", "the pool alone"), ("big", "with the chain")):
        flood = out["overload"][name]
        values = flood["latencies_s"]
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            cdf_ax.plot(values, ys, label=f"{label}: {flood['429']} × 429")
    cdf_ax.set_xlabel("latency of served requests, s")
    cdf_ax.set_ylabel("fraction")
    cdf_ax.set_title(f"{out['overload']['rate']:g} req/s, 15 s each")
    cdf_ax.legend()
    plots.save(fig, path)


def every_pool_up() -> bool:
    return all(p["replicas"] for p in admin("GET", "/admin/status").json()["pools"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--rate", type=float, default=32, help="the overload phase's req/s")
    parser.add_argument("--out", default="loadtest/results/traffic-policy.json")
    parser.add_argument("--png", default="docs/img/traffic-policy.png")
    parser.add_argument("--check", action="store_true", help="exit 1 on a broken expectation")
    args = parser.parse_args(argv)
    if port_answers(LOCAL_URL):
        print(f"{LOCAL_URL} already answers: stop that gateway first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="forge-traffic-") as tmp:
        workdir = Path(tmp)
        config = workdir / "traffic.yaml"
        config.write_text(yaml.safe_dump(serve_config(), sort_keys=False))
        log = workdir / "serve-run.log"
        proc = start_graph(log, config)
        try:
            wait_ready(LOCAL_URL, proc, log, 300)
            if not wait_for(every_pool_up, 300):
                raise RuntimeError("the drill's pools did not all come up")
            out = asyncio.run(drill(args.requests, args.rate, workdir))
        finally:
            stop_graph(proc, drain=False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    plot(out, Path(args.png))
    print(markdown(out))
    failed = problems(out)
    for problem in failed:
        print(f"FAILED {problem}", file=sys.stderr)
    return 1 if args.check and failed else 0


if __name__ == "__main__":
    sys.exit(main())
