"""Drills against the running gateway: cache, usage, quota, disconnect, isolation, Redis loss,
failover. Each leaves the gateway as it found it (faults cleared, Redis unpaused)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import httpx

from evals.gate import Check, Failed, Served, Skipped, expect
from evals.target import Target
from loadtest import traffic

NO_CACHE = {"cache-control": "no-store"}


async def _poll(probe, timeout_s: float, interval_s: float = 0.25):
    """``probe()`` until it returns something truthy, or its last answer after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = await probe()
        if result or time.monotonic() >= deadline:
            return result
        await asyncio.sleep(interval_s)


# -- cache -----------------------------------------------------------------------------------


async def cache_repeat_is_a_hit(target: Target, served: Served) -> str:
    """The same temperature-0 request three times through the ``openai`` client: the last one
    streamed, so the cached answer is checked as SSE too."""
    body = target.chat_body(f"gate cache probe {uuid.uuid4().hex}", max_tokens=16, temperature=0)
    seen: list[tuple[str | None, str | None]] = []  # (x-forge-cache, x-forge-backend)
    async with target.openai() as client:
        texts = []
        for _ in range(2):
            raw = await client.chat.completions.with_raw_response.create(**body)
            seen.append((raw.headers.get("x-forge-cache"), raw.headers.get("x-forge-backend")))
            texts.append(raw.parse().choices[0].message.content)
        raw = await client.chat.completions.with_raw_response.create(**body, stream=True)
        seen.append((raw.headers.get("x-forge-cache"), raw.headers.get("x-forge-backend")))
        texts.append(
            "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
        )
    for cache, backend in seen:
        served.saw(backend, cache)
    (first, first_backend), (second, _), (streamed, _) = seen
    if not target.primary(first_backend):
        # By design the fallback's answers are never cached: the repeat must miss too.
        expect(second != "hit", "a fallback's answer was served from the cache")
        return "fallback answers are not cached (by design)"
    expect(first == "miss", f"first x-forge-cache {first!r}, wanted miss")
    expect(second == "hit", f"repeat x-forge-cache {second!r}, wanted hit")
    expect(texts[1] == texts[0], "the cached answer differs from the original")
    expect(streamed == "hit", f"streamed repeat x-forge-cache {streamed!r}")
    expect(texts[2] == texts[0], "the cached answer streamed as SSE differs from the original")
    return "miss, hit, hit as SSE"


# -- usage -----------------------------------------------------------------------------------


async def _usage_today(client: httpx.AsyncClient) -> dict:
    """The tenant's usage today over every model: what the fallback served is recorded under
    the fallback's own model (its price), not the one asked for."""
    response = await client.get("/v1/usage", params={"group": "total"})
    expect(response.status_code == 200, f"/v1/usage: {response.status_code} {response.text[:120]}")
    lines = response.json()["data"]
    return {
        k: sum(line[k] for line in lines)
        for k in ("requests", "prompt_tokens", "completion_tokens")
    }


async def usage_is_metered(target: Target, served: Served) -> str:
    async with target.http() as client:
        before = await _usage_today(client)
        sent = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}
        for i in range(3):
            response = await client.post(
                "/v1/chat/completions",
                json=target.chat_body(f"gate usage {i}", max_tokens=8),
                headers=NO_CACHE,
            )
            expect(response.status_code == 200, f"{response.status_code}: {response.text[:120]}")
            backend = response.headers.get("x-forge-backend")
            served.saw(backend)
            usage = response.json()["usage"]
            sent["requests"] += 1
            sent["prompt_tokens"] += usage["prompt_tokens"]
            sent["completion_tokens"] += usage["completion_tokens"]

        async def grown():
            now = await _usage_today(client)
            return now if all(now[k] - before[k] >= sent[k] for k in sent) else None

        after = await _poll(grown, timeout_s=15)
    expect(after, f"/v1/usage did not grow by {sent} within 15 s (before {before})")
    return (
        f"+{sent['requests']} requests, +{sent['prompt_tokens']}/{sent['completion_tokens']} tokens"
    )


# -- quota -----------------------------------------------------------------------------------


async def quota_429_with_headers(target: Target, served: Served) -> str:
    key = target.quota_key or target.flood_key
    if not key:
        raise Skipped("needs --quota-key (or --flood-key): a tenant with a small budget")
    body = target.chat_body("gate quota", max_tokens=1)
    refused = None
    async with target.http(key) as client:
        # One at a time: a concurrent burst would meet the tenant's stream cap first.
        for sent in range(1, 252):
            r = await client.post("/v1/chat/completions", json=body, headers=NO_CACHE)
            if r.status_code == 429:
                refused = r
                break
            expect(r.status_code == 200, f"request {sent}: {r.status_code} {r.text[:120]}")
            served.saw(r.headers.get("x-forge-backend"))
            limit = r.headers.get("x-ratelimit-limit-requests")
            if limit is None or int(limit) > 200:
                raise Skipped(f"the quota tenant's budget ({limit or 'no'} rpm) is not small")
    expect(refused is not None, "250 requests and no 429")
    error = refused.json().get("error", {})
    expect(error.get("type") and error.get("code"), f"429 not OpenAI-shaped: {refused.text[:120]}")
    expect(refused.headers.get("retry-after", "").isdigit(), "429 without Retry-After seconds")
    missing = [
        h
        for h in ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests")
        if h not in refused.headers
    ]
    expect(not missing, f"429 without {missing}")
    return (
        f"429 after {sent - 1} requests ({error['code']}), retry-after "
        f"{refused.headers['retry-after']} s, limit {refused.headers['x-ratelimit-limit-requests']}"
    )


# -- disconnect ------------------------------------------------------------------------------


async def _drop_streams(target: Target, n: int, served: Served) -> None:
    # Left after the first token, long before 512: the generation is cut by the client.
    body = target.chat_body("gate: a long answer please", max_tokens=512, stream=True)

    async def one(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=NO_CACHE) as r:
            expect(r.status_code == 200, f"stream {r.status_code}")
            served.saw(r.headers.get("x-forge-backend"))
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return  # leave after the first token: the client is gone

    async with target.http() as client:
        await asyncio.gather(*(one(client) for _ in range(n)))


async def disconnect_frees_slots_and_caps(target: Target, served: Served) -> str:
    n = target.profile.disconnect_streams
    await _drop_streams(target, n, served)
    said = []

    seen_cap = False

    async def leases_free():
        # No header: the tenant has no cap, or this answer was served unmetered (store slow).
        nonlocal seen_cap
        async with target.http() as client:
            r = await client.post(
                "/v1/chat/completions",
                json=target.chat_body("gate after", max_tokens=2),
                headers=NO_CACHE,
            )
        limit = r.headers.get("x-ratelimit-limit-concurrent-requests")
        if limit is None:
            return None
        seen_cap = True
        left = int(r.headers["x-ratelimit-remaining-concurrent-requests"])
        return f"{left + 1}/{limit} free" if left + 1 == int(limit) else None

    caps = await _poll(leases_free, timeout_s=3, interval_s=0.5)  # a tenant without a cap
    if not caps and seen_cap:
        caps = await _poll(leases_free, timeout_s=12, interval_s=0.5)
    if caps:
        said.append(f"streams {caps}")
    elif seen_cap:
        raise Failed(f"the tenant's concurrent-request cap not free 15 s after {n} dropped streams")

    slots = None
    if target.admin_key and target.pool:

        async def slots_free():
            status = (await target.admin("GET", "/admin/status")).json()
            pool = next(p for p in status["pools"] if p["name"] == target.pool)
            admission = pool.get("admission")
            if admission is None:
                return "no admission"
            return "slots 0 in flight" if not any(admission["inflight"].values()) else None

        slots = await _poll(slots_free, timeout_s=15, interval_s=0.5)
        expect(slots, f"admission slots still in flight 15 s after {n} dropped streams")
        said.append(slots)
    if not seen_cap and slots in (None, "no admission"):
        raise Skipped("nothing to observe: the tenant has no stream cap and no admission status")
    return f"{n} streams dropped; " + ", ".join(said)


# -- isolation -------------------------------------------------------------------------------


async def isolation_victim_unharmed(target: Target, served: Served) -> str:
    if not target.flood_key:
        raise Skipped("needs --flood-key: a second tenant to flood")
    spec = target.profile.isolation
    flood = traffic.Stream(
        name="flood",
        key=target.flood_key,
        rate=spec.flood_rate,
        prompt_tokens=64,
        max_tokens=64,
        model=target.model,
        headers=NO_CACHE,
    )
    victim: list[tuple[int, float, str | None]] = []

    async def victim_requests() -> None:
        await asyncio.sleep(min(2.0, spec.flood_s / 4))  # into the flood
        async with target.http() as client:
            for i in range(spec.victim_requests):
                started = time.perf_counter()
                body = target.chat_body(f"gate victim {i}", max_tokens=16, stream=True)
                async with client.stream(
                    "POST", "/v1/chat/completions", json=body, headers=NO_CACHE
                ) as r:
                    await r.aread()
                victim.append(
                    (r.status_code, time.perf_counter() - started, r.headers.get("x-forge-backend"))
                )

    flooded, _ = await asyncio.gather(
        traffic.run(target.base_url, [flood], spec.flood_s, seed=3), victim_requests()
    )
    for _status, _seconds, backend in victim:
        served.saw(backend)
    ok = [v for v in victim if v[0] == 200 and v[1] <= spec.victim_total_s]
    statuses: dict[int, int] = {}
    for r in flooded:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    worst = max((v[1] for v in victim), default=0.0)
    expect(
        len(ok) == spec.victim_requests,
        f"victim {len(ok)}/{spec.victim_requests} within {spec.victim_total_s} s "
        f"(statuses {[v[0] for v in victim]}, worst {worst:.2f} s)",
    )
    bad = {s: n for s, n in statuses.items() if s not in (200, 429)}
    expect(not bad, f"the flooding tenant saw {bad}: shedding must be a 429")
    return (
        f"victim {len(ok)}/{spec.victim_requests} (worst {worst:.2f} s); "
        f"flood {statuses.get(200, 0)} served, {statuses.get(429, 0)} shed with 429"
    )


# -- Redis loss ------------------------------------------------------------------------------


async def _store_errors(target: Target) -> int:
    status = (await target.admin("GET", "/admin/status")).json()
    return sum(status["store"]["errors"].values())


async def redis_loss_fails_open(target: Target, served: Served) -> str:
    target.need_admin()
    if target.store_kind == "embedded":
        raise Skipped("embedded store: no Redis configured to lose")
    if not target.redis_url:
        raise Skipped("Redis configured: pass --redis-url to drill its loss")
    import redis.asyncio as aioredis

    pause_s = 4.0
    before = await _store_errors(target)
    client = aioredis.from_url(target.redis_url, socket_timeout=5)
    statuses = []
    try:
        # Every client's commands block for pause_s: to the gateway Redis is gone (its calls
        # time out); Redis itself ends the pause even if this process dies.
        await client.execute_command("CLIENT", "PAUSE", int(pause_s * 1000), "ALL")
        started = time.monotonic()
        async with target.http() as http:
            for i in range(5):
                r = await http.post(
                    "/v1/chat/completions",
                    json=target.chat_body(f"gate redis loss {i}", max_tokens=4),
                    headers=NO_CACHE,
                )
                statuses.append(r.status_code)
                served.saw(r.headers.get("x-forge-backend"))
        during_s = time.monotonic() - started
    finally:
        with contextlib.suppress(Exception):
            await client.execute_command("CLIENT", "UNPAUSE")
        await client.aclose()
    expect(all(s == 200 for s in statuses), f"statuses while Redis was gone: {statuses}")
    expect(during_s < pause_s, f"5 requests took {during_s:.1f} s: they waited for Redis")

    async def counted():
        return max(0, await _store_errors(target) - before)

    errors = await _poll(counted, timeout_s=10, interval_s=0.5)
    expect(errors, "no store error counted by the answering gateway (/admin/status)")

    async def store_back():
        status = (await target.admin("GET", "/admin/status")).json()
        return status["store"]["state"] == "closed"

    back = await _poll(store_back, timeout_s=15, interval_s=0.5)
    expect(back, "the gateway still skips the store 15 s after Redis returned")
    return f"5/5 served in {during_s:.2f} s while paused; {errors} store errors counted; store back"


# -- failover --------------------------------------------------------------------------------


def _pool_breakers(breakers: dict, pool: str) -> dict:
    return {k: v for k, v in breakers.items() if k == pool or k.startswith(pool + "/")}


async def failover_drill(target: Target, served: Served) -> str:
    target.need_admin()
    if target.pool is None:
        raise Failed(f"no pool serves {target.model} (/admin/status)")
    if not target.primary_serving:
        raise Skipped("primary absent: every answer is the fallback's; nothing to fail over from")
    if not target.fallback:
        raise Skipped(f"{target.pool} has no fallback to fail over to")
    if not target.faults:
        raise Skipped("fault injection is off on this gateway (faults.enabled: false)")
    spec = target.profile.failover
    load = traffic.Stream(
        name="failover",
        key=target.key,
        rate=spec.rate,
        prompt_tokens=32,
        max_tokens=spec.max_tokens,
        model=target.model,
        headers=NO_CACHE,
    )
    before = _pool_breakers((await target.admin("GET", "/admin/breakers")).json(), target.pool)
    marks: dict[str, float] = {}

    async def fault(mode: str) -> None:
        await target.admin(
            "POST", "/admin/faults", json={"pool": target.pool, "fault": {"mode": mode}}
        )

    async def control(t0: float) -> None:
        await asyncio.sleep(spec.fault_after_s)
        marks["fault"] = time.perf_counter() - t0
        await fault("error")
        await asyncio.sleep(spec.fault_for_s)
        marks["clear"] = time.perf_counter() - t0
        await fault("none")

    duration = spec.fault_after_s + spec.fault_for_s + spec.home_within_s
    t0 = time.perf_counter()
    try:
        results, _ = await asyncio.gather(
            traffic.run(target.base_url, [load], duration, seed=5), control(t0)
        )
    finally:
        await fault("none")  # whatever happened above, the pool is not left faulted
    for r in results:
        served.saw(r.backend, r.cache)
    failed = [r for r in results if r.error or r.truncated]
    expect(
        not failed,
        f"{len(failed)} client-visible errors of {len(results)} "
        f"({sorted({r.error or 'truncated' for r in failed})})",
    )
    during = [r for r in results if marks["fault"] <= r.start < marks["clear"]]
    by_fallback = sum(r.backend == "fallback" for r in during)
    expect(by_fallback, "nothing served by the fallback while the primary failed")
    home = [r for r in results if r.start >= marks["clear"] and target.primary(r.backend)]
    expect(home, f"no request served by {target.pool} within {spec.home_within_s} s of the clear")
    home_s = min(r.start for r in home) - marks["clear"]
    after = _pool_breakers((await target.admin("GET", "/admin/breakers")).json(), target.pool)
    probes = []
    for name, view in after.items():
        seen = len((before.get(name) or {}).get("probes_per_half_open", []))
        probes += view.get("probes_per_half_open", [])[seen:]
    expect(
        all(p == 1 for p in probes), f"half-open periods let {probes} probes through, not 1 each"
    )
    state = after.get(target.pool, {}).get("state", "closed")
    expect(state == "closed", f"the pool's breaker is {state} after the drill")
    return (
        f"{len(results)} requests, 0 errors, {by_fallback}/{len(during)} by fallback during the "
        f"fault; home {home_s:.1f} s after the clear; probes per half-open {probes}"
    )


def checks() -> list[Check]:
    return [
        Check("cache:repeat-is-a-hit", cache_repeat_is_a_hit, "cache"),
        Check("metering:usage-counted", usage_is_metered, "metering"),
        Check("quota:429-with-headers", quota_429_with_headers, "quota"),
        Check("disconnect:slots-and-caps-freed", disconnect_frees_slots_and_caps, "disconnect"),
        Check("isolation:victim-within-slo", isolation_victim_unharmed, "isolation"),
        Check("store:redis-loss-fails-open", redis_loss_fails_open, "store"),
        Check("failover:drill", failover_drill, "failover"),
    ]
