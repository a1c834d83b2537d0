"""Metering: what one request adds to its tenant's day, how a report reads it back, and that a
mixed run through a real gateway on a real socket is charged exactly what the engines counted."""

from __future__ import annotations

import asyncio
import datetime as dt

import httpx
import openai
import pytest

from serve_app.auth.keys import hash_key
from serve_app.config.models import ConfigError, MeteringConfig, load_config
from serve_app.local import build_local_gateway
from serve_app.metering.book import BookError
from serve_app.metering.ledger import (
    UsageLedger,
    UsageRecord,
    build_book,
    date_range,
    error_class,
    totals,
)
from serve_app.metering.postgres import PostgresBook
from serve_app.metering.sqlite import SqliteBook
from serve_app.mock_openai import create_mock_app
from serve_app.stages.metering import usage_record
from tests.backends.loopback import serve_on_loopback
from tests.doubles import RecordingMetrics, make_ctx
from tests.polling import eventually_async

KEY, OTHER_KEY, CAPPED_KEY = "sk-test-meter", "sk-test-other", "sk-test-capped"
UPSTREAM_KEY, KEY_ENV = "sk-test-upstream", "FORGE_TEST_METER_UPSTREAM_KEY"
MODEL = "forge-sim"
FAST = {"decode_base_s": 0.001, "output_tokens_min": 4, "output_tokens_max": 8}
TODAY = dt.datetime.now(dt.UTC).date()


# -- one request's record ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (200, None),
        (400, "invalid"),
        (413, "invalid"),
        (429, "rate_limited"),
        (499, "disconnected"),
        (502, "upstream"),
        (504, "upstream"),
        (599, "truncated"),
    ],
)
def test_each_status_counts_under_its_class(status, cls):
    assert error_class(status) == cls


def test_a_served_answer_is_charged_the_backends_usage():
    ctx = make_ctx(stream=False)
    ctx.tenant = load_config(config_args()).tenants[0]
    ctx.backend, ctx.usage = "primary", {"prompt_tokens": 9, "completion_tokens": 5}
    ctx.first_byte_at = 1.0
    record = usage_record(ctx, 200, "2026-11-30")
    assert dict(record.counts) == {"requests": 1, "prompt_tokens": 9, "completion_tokens": 5}


def test_a_cache_hit_is_metered_as_cached_not_as_generated():
    ctx = make_ctx(stream=False)
    ctx.cache, ctx.backend, ctx.first_byte_at = "hit", "cache", 1.0
    ctx.usage = {"prompt_tokens": 9, "completion_tokens": 5}
    counts = usage_record(ctx, 200, "2026-11-30").counts
    assert counts == {"requests": 1, "cached_requests": 1, "cached_tokens": 14}


def test_without_a_backends_usage_the_estimate_is_charged_and_flagged():
    ctx = make_ctx()
    ctx.backend, ctx.first_byte_at, ctx.frames_sent = "fallback", 1.0, 3
    counts = usage_record(ctx, 499, "2026-11-30").counts
    assert counts["estimated_requests"] == 1 and counts["completion_tokens"] == 3
    assert counts["prompt_tokens"] > 0
    assert counts["fallback_requests"] == 1 and counts["errors_disconnected"] == 1


def test_what_the_fallback_served_is_recorded_under_its_own_model():
    ctx = make_ctx(stream=False)
    ctx.backend, ctx.served_model, ctx.first_byte_at = "fallback", "mock-gemini", 1.0
    ctx.usage = {"prompt_tokens": 9, "completion_tokens": 5}
    record = usage_record(ctx, 200, "2026-11-30")
    assert record.model == "mock-gemini"  # priced at the upstream's price, not the pool's
    assert record.counts["fallback_requests"] == 1 and record.counts["prompt_tokens"] == 9
    ctx.cache = "hit"  # a replay of a cached answer is the requested model's
    assert usage_record(ctx, 200, "2026-11-30").model == ctx.model_label


def test_a_refusal_before_the_first_byte_is_charged_nothing():
    counts = usage_record(make_ctx(), 429, "2026-11-30").counts
    assert counts == {
        "requests": 1,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "errors_rate_limited": 1,
    }


# -- the ledger ---------------------------------------------------------------------------------


async def test_a_report_sums_days_and_models_and_filters_by_model(tmp_path):
    ledger = UsageLedger(SqliteBook(tmp_path / "usage.sqlite3"))
    for day, model, n in [("2026-11-29", "a", 1), ("2026-11-30", "a", 2), ("2026-11-30", "b", 4)]:
        ledger.add(UsageRecord("t", model, day, {"requests": n, "prompt_tokens": 10 * n}))
        await ledger.flush()
    start, end = dt.date(2026, 11, 29), dt.date(2026, 11, 30)
    by_day = await ledger.read(["t"], start, end)
    assert [(r.day, r.model, r["requests"]) for r in by_day] == [
        ("2026-11-29", "a", 1),
        ("2026-11-30", "a", 2),
        ("2026-11-30", "b", 4),
    ]
    summed = await ledger.read(["t", "nobody"], start, end, by_day=False)
    assert [(r.model, r["requests"], r["prompt_tokens"]) for r in summed] == [
        ("a", 3, 30),
        ("b", 4, 40),
    ]
    only_b = await ledger.read(["t"], start, end, model="b")
    assert totals(only_b) == {"requests": 4, "prompt_tokens": 40}


class TimesOutAfterWriting(SqliteBook):
    """A book whose first ``fails`` writes are committed but answer an error: the worst case
    for a retry (was it applied or not?)."""

    def __init__(self, path, fails: int) -> None:
        super().__init__(path)
        self.fails = fails
        self.errors: list[BookError] = []

    async def write(self, batch_id, entries) -> bool:
        applied = await super().write(batch_id, entries)
        if self.fails > 0:
            self.fails -= 1
            raise BookError("timed out (after the commit)")
        return applied


async def test_a_write_that_timed_out_is_retried_and_counted_once(tmp_path):
    book = TimesOutAfterWriting(tmp_path / "usage.sqlite3", fails=2)
    ledger = UsageLedger(book, flush_s=0.01, on_error=book.errors.append)
    ledger.add(UsageRecord("t", "m", "2026-11-30", {"requests": 1, "prompt_tokens": 5}))
    ledger.add(UsageRecord("t", "m", "2026-11-30", {"requests": 1, "prompt_tokens": 7}))
    await eventually_async(
        lambda: not ledger.queued,
        timeout_s=5,
        what="the flusher to retry the batch until the book confirmed it",
        explain=lambda: book.errors,
    )
    assert len(book.errors) == 2
    rows = await ledger.read(["t"], dt.date(2026, 11, 30), dt.date(2026, 11, 30))
    assert totals(rows) == {"requests": 2, "prompt_tokens": 12}


async def test_records_that_arrive_during_an_unconfirmed_write_are_kept_apart(tmp_path):
    book = TimesOutAfterWriting(tmp_path / "usage.sqlite3", fails=1)
    ledger = UsageLedger(book, flush_s=60, on_error=book.errors.append)
    ledger.add(UsageRecord("t", "m", "2026-11-30", {"requests": 1}))
    await ledger.flush()  # applied, but the answer was an error: it stays unconfirmed
    ledger.add(UsageRecord("t", "m", "2026-11-30", {"requests": 10}))
    await ledger.flush()  # the retry of the first batch (a repeat: adds nothing)
    await ledger.flush()  # then the second
    rows = await ledger.read(["t"], dt.date(2026, 11, 30), dt.date(2026, 11, 30))
    assert totals(rows) == {"requests": 11} and ledger.queued == 0


async def test_a_closing_gateway_writes_what_it_queued_and_a_new_one_reads_it(tmp_path):
    """The gateway replica stops (or is replaced): the usage it queued is in the file, and the
    next replica's ledger reports it."""
    path = tmp_path / "usage.sqlite3"
    ledger = UsageLedger(SqliteBook(path), flush_s=60)
    ledger.add(UsageRecord("t", "m", "2026-11-30", {"requests": 3}))
    await ledger.aclose()
    again = UsageLedger(SqliteBook(path))
    rows = await again.read(["t"], dt.date(2026, 11, 30), dt.date(2026, 11, 30))
    assert totals(rows) == {"requests": 3}
    await again.aclose()


def test_a_ledger_named_by_an_unset_variable_stops_start_up(monkeypatch):
    monkeypatch.delenv("FORGE_TEST_NO_LEDGER", raising=False)
    config = MeteringConfig(database_url_env="FORGE_TEST_NO_LEDGER")
    with pytest.raises(ConfigError, match="FORGE_TEST_NO_LEDGER"):
        build_book(config)
    monkeypatch.setenv("FORGE_TEST_NO_LEDGER", "postgresql://127.0.0.1:1/x")
    assert isinstance(build_book(config), PostgresBook)
    assert isinstance(build_book(MeteringConfig()), SqliteBook)


def test_a_reversed_or_overlong_range_is_refused():
    with pytest.raises(ValueError, match="before"):
        date_range(dt.date(2026, 11, 30), dt.date(2026, 11, 1))
    with pytest.raises(ValueError, match="at most"):
        date_range(dt.date(2020, 1, 1), dt.date(2026, 1, 1))
    assert len(date_range(dt.date(2026, 2, 27), dt.date(2026, 3, 1))) == 3


# -- through a gateway on a real socket -----------------------------------------------------------


def config_args(**extra) -> dict:
    return {
        "tenants": [
            {"name": "meter", "key_hashes": [hash_key(KEY)], "limits": {"tpm": 1_000_000}},
            {"name": "other", "key_hashes": [hash_key(OTHER_KEY)]},
            {
                "name": "capped",
                "key_hashes": [hash_key(CAPPED_KEY)],
                "limits": {"rpm": 1, "burst_requests": 1},
            },
        ],
        "pools": [
            {
                "name": "primary",
                "model": MODEL,
                "engine": FAST,
                "deployment": {"num_replicas": 2},
            }
        ],
        "fallback": {
            "base_url": "http://upstream.test/v1",
            "model": "mock-gemini",
            "api_key_env": KEY_ENV,
        },
        **extra,
    }


@pytest.fixture
def upstream_app():
    return create_mock_app("mock-gemini", FAST, api_key=UPSTREAM_KEY)


@pytest.fixture
async def served(monkeypatch, upstream_app):
    """A gateway on 127.0.0.1 (real sockets: a client can really leave mid-stream)."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    transport = httpx.ASGITransport(upstream_app)
    # Usage written every 10 ms, not every second: a test waits for it (``metered``).
    config = load_config(config_args(metering={"flush_s": 0.01}))
    gateway = build_local_gateway(config, fallback_transport=transport)
    async with gateway.lifespan(), serve_on_loopback(gateway.asgi_app()) as url:
        yield gateway, url, transport


async def engine_counts(gateway, upstream: httpx.ASGITransport) -> dict[str, int]:
    stats = [r.engine.stats().as_dict() for r in gateway.backends["primary"].replicas.values()]
    async with httpx.AsyncClient(transport=upstream, base_url="http://upstream.test") as client:
        stats.append((await client.get("/stats")).json())
    return {
        "prompt_tokens": sum(s["prompt_tokens"] for s in stats),
        "completion_tokens": sum(s["generation_tokens"] for s in stats),
    }


async def test_a_mixed_run_is_charged_exactly_what_the_engines_counted(served):
    gateway, url, upstream = served
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)

    def ask(i: int, **extra) -> dict:
        messages = [{"role": "user", "content": f"request {i} about metering"}]
        return {"model": MODEL, "messages": messages, **extra}

    async def streamed(i: int) -> None:
        stream = await client.chat.completions.create(**ask(i), stream=True)
        async for _ in stream:
            pass

    async def dropped(i: int) -> None:
        body = {**ask(i), "max_tokens": 500, "ignore_eos": True, "stream": True}
        async with (
            httpx.AsyncClient(base_url=url) as http,
            http.stream(
                "POST",
                "/v1/chat/completions",
                json=body,
                headers={"authorization": f"Bearer {KEY}"},
            ) as response,
        ):
            lines = 0
            async for line in response.aiter_lines():
                lines += line.startswith("data: ")
                if lines == 4:
                    return  # the client leaves; the engine has generated more than it read

    async with client:
        await asyncio.gather(
            *(client.chat.completions.create(**ask(i), max_tokens=6) for i in range(4)),
            *(streamed(10 + i) for i in range(4)),
            *(dropped(20 + i) for i in range(3)),
        )
        # The pool fails before its first byte: the fallback serves (and is charged once).
        for replica in gateway.backends["primary"].replicas.values():
            replica.set_fault({"mode": "error"})
        failed_over = await client.chat.completions.with_raw_response.create(**ask(30))
        assert failed_over.headers["x-forge-backend"] == "fallback"
        for replica in gateway.backends["primary"].replicas.values():
            replica.set_fault(None)

    async def report() -> dict[str, int]:
        return totals(await gateway.ledger.read(["meter"], TODAY, TODAY))

    await metered(report, 12)
    used = await report()
    generated = await engine_counts(gateway, upstream)
    assert used["prompt_tokens"] == generated["prompt_tokens"]
    assert used["completion_tokens"] == generated["completion_tokens"]
    assert used["fallback_requests"] == 1
    assert used["errors_disconnected"] == 3
    # The fallback's tokens are under its own model (its price), the pool's under the pool's.
    rows = await gateway.ledger.read(["meter"], TODAY, TODAY)
    by_model = {r.model: r for r in rows}
    assert set(by_model) == {MODEL, "mock-gemini"}
    assert by_model["mock-gemini"]["fallback_requests"] == 1
    assert by_model["mock-gemini"]["requests"] == 1 and by_model[MODEL]["fallback_requests"] == 0
    assert by_model["mock-gemini"]["completion_tokens"] > 0
    assert "estimated_requests" not in used


async def metered(report, requests: int) -> None:
    """Records are written after each response ends, off the request path: wait for them."""
    for _ in range(500):
        if (await report()).get("requests") == requests:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {requests} requests metered, got {await report()}")


async def test_refusals_are_metered_as_errors_of_their_class(served):
    gateway, url, _ = served
    headers = {"authorization": f"Bearer {CAPPED_KEY}"}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with httpx.AsyncClient(base_url=url, headers=headers) as http:
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 429
        bad = await http.post("/v1/chat/completions", json={**body, "max_tokens": -1})
        assert bad.status_code == 400

    async def report() -> dict[str, int]:
        return totals(await gateway.ledger.read(["capped"], TODAY, TODAY))

    await metered(report, 3)
    used = await report()
    assert used["errors_rate_limited"] == 1 and used["errors_invalid"] == 1


class LedgerOutage(SqliteBook):
    """A ledger database that is unreachable (every write a ``BookError``) until ``end()``."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.down = True

    def end(self) -> None:
        self.down = False

    async def write(self, batch_id, entries) -> bool:
        if self.down:
            raise BookError("database down (test double)")
        return await super().write(batch_id, entries)


async def test_with_the_ledger_down_requests_are_served_and_their_usage_waits(
    monkeypatch, upstream_app, tmp_path
):
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    metrics, book = RecordingMetrics(), LedgerOutage(tmp_path / "usage.sqlite3")
    gateway = build_local_gateway(
        # Written every 10 ms, not every second: the failed write comes (and is counted) soon.
        load_config(config_args(metering={"flush_s": 0.01})),
        metrics=metrics,
        fallback_transport=httpx.ASGITransport(upstream_app),
        book=book,
    )
    async with gateway.lifespan():
        transport = httpx.ASGITransport(gateway.asgi_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://forge.test") as http:
            answer = await http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                headers={"authorization": f"Bearer {OTHER_KEY}"},
            )
        assert answer.status_code == 200
        await eventually_async(
            lambda: {"op": "meter"} in metrics.store_errors.calls,
            timeout_s=5,
            what="the write the database refused to be counted",
        )
        assert gateway.ledger.queued > 0, "kept queued, not dropped"
        # The database is back before the gateway stops: the queued batch lands (a gateway
        # that stops with it still down retries for 5 s, UsageLedger.aclose's timeout).
        book.end()
    assert {"tenant": "other", "model": MODEL, "kind": "prompt"} in metrics.tokens.calls
    assert gateway.ledger.queued == 0
    again = SqliteBook(tmp_path / "usage.sqlite3")
    rows = await UsageLedger(again).read(["other"], TODAY, TODAY)
    assert totals(rows)["requests"] == 1 and totals(rows)["prompt_tokens"] > 0
    await again.close()
