"""Metering is exact: after a mixed run, a tenant's usage report equals what the backends
themselves counted, token for token, and Prometheus says the same.

The run mixes what makes metering hard, on the chat, Responses and Messages routes alike:
streams and non-streams, cache hits, clients that leave mid-stream or before a non-streamed
answer came (charged what the engine produced, collected from the replica after the abort),
and requests whose first try failed on the pool and were served by the fallback (charged once).
The ground truth is the engines' own cumulative counters: the metered pool's replicas (nobody
else sends to them) and the mock fallback's engine (``GET /mock/stats``), read before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt

import anthropic
import httpx
import openai
import pytest

from serve_app.replica import admin as replica_admin
from tests.e2e.conftest import (
    ADMIN_KEY,
    APP,
    METERED_POOL,
    METERED_TENANT,
    tenant_key,
)
from tests.polling import eventually

pytestmark = pytest.mark.e2e

MODEL = "forge-metered"
PLAIN, STREAMED, CACHED, DROPPED, LEFT, FAILED_OVER = 8, 8, 4, 6, 4, 6
# Per dialect (the Responses and Messages APIs): plain and streamed; a cache miss then a hit as
# a stream; and one request failed over.
SPOKEN = 3


def engine_counts(forge_url: str) -> dict[str, int]:
    """Prompt and generated tokens of the metered pool's engines and the fallback's."""
    stats = replica_admin.all_stats(APP, f"pool-{METERED_POOL}")
    stats.append(httpx.get(f"{forge_url}/mock/stats", timeout=10).json())
    return {
        "prompt_tokens": sum(s["prompt_tokens"] for s in stats),
        "completion_tokens": sum(s["generation_tokens"] for s in stats),
    }


def metered_pool_idle() -> bool:
    stats = replica_admin.all_stats(APP, f"pool-{METERED_POOL}")
    return all(s["num_requests_running"] + s["num_requests_waiting"] == 0 for s in stats)


def report(forge_url: str) -> dict[str, int]:
    """The tenant's usage today, all models summed, from the admin API."""
    today = dt.datetime.now(dt.UTC).date().isoformat()
    answer = httpx.get(
        f"{forge_url}/admin/usage",
        params={"tenant": METERED_TENANT, "start": today, "end": today, "group": "total"},
        headers={"authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    )
    assert answer.status_code == 200, answer.text
    totals: dict[str, int] = {}
    for row in answer.json()["data"]:
        errors = {f"errors_{name}": n for name, n in row.pop("errors").items()}
        for name, value in {**row, **errors}.items():
            if isinstance(value, int):
                totals[name] = totals.get(name, 0) + value
    return totals


def prometheus_tokens(metrics_port: int) -> dict[str, float]:
    """``ray_forge_tokens_total`` of the tenant by kind, summed over the gateway replicas, as
    Ray's metrics port exports it to Prometheus."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
    kinds: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("ray_forge_tokens_total{") and f'tenant="{METERED_TENANT}"' in line:
            labels, value = line.rsplit(" ", 1)
            kind = labels.split('kind="', 1)[1].split('"', 1)[0]
            kinds[kind] = kinds.get(kind, 0.0) + float(value)
    return kinds


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}


async def mixed_run(forge_url: str, faults) -> int:
    """The run; returns how many requests it sent."""
    key = tenant_key(METERED_TENANT)
    client = openai.AsyncOpenAI(base_url=f"{forge_url}/v1", api_key=key, max_retries=0)

    def ask(i: int, **extra) -> dict:
        content = f"metering request {i}: tell me about gateways"
        return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}

    async def streamed(i: int, **extra) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            **ask(i, **extra), stream=True, stream_options={"include_usage": True}
        )
        async for _ in raw.parse():
            pass
        return raw.headers["x-forge-cache"]

    async def dropped(i: int) -> None:
        body = {**ask(i), "max_tokens": 2000, "ignore_eos": True, "stream": True}
        headers = {"authorization": f"Bearer {key}"}
        async with (
            httpx.AsyncClient(base_url=forge_url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response,
        ):
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 5:
                    return  # leaves mid-stream: the connection closes

    async def left(i: int) -> None:
        """A non-streamed request whose client gives up mid-generation."""
        body = {**ask(i), "max_tokens": 2000, "ignore_eos": True}
        headers = {"authorization": f"Bearer {key}"}
        # Half a second to read the answer, not to connect: among the run's ~100 concurrent
        # requests a connect can take longer (CI saw a ConnectTimeout here).
        timeout = httpx.Timeout(30, read=0.5)
        async with httpx.AsyncClient(base_url=forge_url, timeout=timeout) as http:
            with contextlib.suppress(httpx.ReadTimeout):
                await http.post("/v1/chat/completions", json=body, headers=headers)
                raise AssertionError("a 2,000-token answer came within half a second")

    claude = anthropic.AsyncAnthropic(base_url=forge_url, api_key=key, max_retries=0)

    def said(i: int) -> str:
        return f"metering request {i}: tell me about gateways"

    async def response(i: int, stream: bool = False, **extra) -> str:
        raw = await client.responses.with_raw_response.create(
            model=MODEL, input=said(i), max_output_tokens=24, stream=stream, **extra
        )
        if stream:
            async for _ in raw.parse():
                pass
        return raw.headers["x-forge-cache"]

    async def message(i: int, stream: bool = False, temperature: float | None = None) -> str:
        ask = {"model": MODEL, "max_tokens": 24, "messages": [{"role": "user", "content": said(i)}]}
        # Today's SDK has no sampling parameters (newer Claude models refuse them); the route
        # takes them, as older SDKs and raw HTTP clients send them.
        extra = {"extra_body": {"temperature": temperature}} if temperature is not None else {}
        if not stream:
            return (await claude.messages.with_raw_response.create(**ask, **extra)).headers[
                "x-forge-cache"
            ]
        async with claude.messages.with_streaming_response.create(
            **ask, **extra, stream=True
        ) as raw:
            async for _ in raw.iter_lines():
                pass
            return raw.headers["x-forge-cache"]

    async with client, claude:
        await asyncio.gather(
            *(client.chat.completions.create(**ask(i), max_tokens=24) for i in range(PLAIN)),
            *(streamed(100 + i, max_tokens=24) for i in range(STREAMED)),
            *(dropped(200 + i) for i in range(DROPPED)),
            *(left(250 + i) for i in range(LEFT)),
            *(response(500 + i, stream=i % 2 == 1) for i in range(SPOKEN)),
            *(message(600 + i, stream=i % 2 == 1) for i in range(SPOKEN)),
        )
        sent = PLAIN + STREAMED + DROPPED + LEFT + 2 * SPOKEN
        # A miss, then a hit as this API's stream. Each its own prompt: the two APIs'
        # translations of one question are one chat request, and share its cache entry.
        for i, speak in enumerate((response, message)):
            await speak(700 + i, temperature=0)
            sent += 1
            for _ in range(50):
                sent += 1
                if await speak(700 + i, stream=True, temperature=0) == "hit":
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"a temperature-0 repeat on {speak.__name__} never hit")
        for i in range(CACHED):  # a miss, then a hit in the other shape
            await client.chat.completions.create(**ask(300 + i), temperature=0, max_tokens=16)
            sent += 1
            # The entry is written once the miss's response has ended: a repeat that comes
            # first is a miss again (served and metered as one).
            for _ in range(50):
                sent += 1
                if await streamed(300 + i, temperature=0, max_tokens=16) == "hit":
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("a temperature-0 repeat never became a cache hit")
        faults.set_all(f"pool-{METERED_POOL}", {"mode": "error"})
        served = await asyncio.gather(
            *(
                client.chat.completions.with_raw_response.create(**ask(400 + i), max_tokens=12)
                for i in range(FAILED_OVER)
            )
        )
        assert [r.headers["x-forge-backend"] for r in served] == ["fallback"] * FAILED_OVER
        spoken = await asyncio.gather(
            client.responses.with_raw_response.create(
                model=MODEL, input=said(800), max_output_tokens=12
            ),
            claude.messages.with_raw_response.create(
                model=MODEL, max_tokens=12, messages=[{"role": "user", "content": said(801)}]
            ),
        )
        assert [r.headers["x-forge-backend"] for r in spoken] == ["fallback"] * 2
        return sent + FAILED_OVER + 2


def test_usage_equals_the_backends_own_counts_exactly(forge_url, metrics_port, faults):
    engines_before, report_before = engine_counts(forge_url), report(forge_url)
    prometheus_before = prometheus_tokens(metrics_port)

    sent = asyncio.run(mixed_run(forge_url, faults))
    eventually(
        # A record is written when its response ends: a dropped stream's once the proxy has
        # told the gateway its client left (or, at worst, once its generation ended).
        lambda: delta(report(forge_url), report_before).get("requests") == sent,
        timeout_s=60,
        interval_s=0.5,
        what=f"the usage report to count the {sent} requests sent",
        explain=lambda: delta(report(forge_url), report_before),
    )
    # The ground truth is final once no generation is left on the metered pool (a stream whose
    # client left is aborted on its replica a moment after the gateway noticed).
    eventually(
        lambda: metered_pool_idle(),
        timeout_s=30,
        what="the metered pool's engines to have nothing running or waiting",
    )
    used = delta(report(forge_url), report_before)
    generated = delta(engine_counts(forge_url), engines_before)
    # Every dropped stream and every request left before its answer is charged the engine's own
    # count, none the gateway's estimate nor nothing: the replica ends a generation when the
    # gateway asks what it cost, not when Serve's cancellation reaches it
    # (``Replica.abandoned_usage``).
    assert used["estimated_requests"] == 0, used
    assert used["prompt_tokens"] == generated["prompt_tokens"], (used, generated)
    assert used["completion_tokens"] == generated["completion_tokens"], (used, generated)
    assert used["cached_requests"] == CACHED + 2  # and one per dialect
    assert used["cached_tokens"] > 0
    assert used["fallback_requests"] == FAILED_OVER + 2

    def prometheus_agrees() -> bool:
        counted = delta(prometheus_tokens(metrics_port), prometheus_before)
        return all(
            counted.get(kind, 0) == used[f"{kind}_tokens"]
            for kind in ("prompt", "completion", "cached")
        )

    eventually(
        prometheus_agrees,
        timeout_s=30,
        interval_s=0.5,
        what="ray_forge_tokens_total to agree with the usage report",
        explain=lambda: (delta(prometheus_tokens(metrics_port), prometheus_before), used),
    )
