"""A client that leaves before its answer is charged what the engine spent on it: through the
in-process gateway (``tests/gateway/test_server.py``'s), real replicas and engines, the client's
request cancelled as Serve cancels a request whose client went, then the tenant's usage in the
ledger read against the engines' own counters."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json

import httpx
import pytest

from serve_app.config.models import load_config
from serve_app.local import build_local_gateway
from serve_app.mock_openai import create_mock_app
from tests.doubles import RecordingMetrics
from tests.gateway.test_server import FAST, KEY, KEY_ENV, MODEL, UPSTREAM_KEY, forge_args, http
from tests.gateway.test_server import upstream as mock_upstream
from tests.polling import eventually_async

LONG = {"max_tokens": 2000, "ignore_eos": True}


def engine_totals(gateway) -> dict[str, int]:
    stats = [r.stats() for r in gateway.backends["primary"].replicas.values()]
    return {
        "prompt_tokens": sum(s["prompt_tokens"] for s in stats),
        "completion_tokens": sum(s["generation_tokens"] for s in stats),
        "running": sum(s["num_requests_running"] + s["num_requests_waiting"] for s in stats),
    }


def slow_pool_gateway(metrics=None):
    """The in-process gateway, its pool slow enough to cancel a request mid-generation."""
    args = forge_args()
    args["pools"][0]["engine"] = {**FAST, "decode_base_s": 0.005}
    return build_local_gateway(
        load_config(args), metrics=metrics, fallback_transport=mock_upstream()
    )


def long_answer(model: str = MODEL) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me everything about gateways"}],
        **LONG,
    }


async def leave_mid_generation(client, body: dict, started) -> None:
    """Send ``body`` and leave once ``started()`` holds, as Serve cancels a left request."""
    sent = asyncio.create_task(
        client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"})
    )
    await eventually_async(started, timeout_s=10, what="the generation to be under way")
    assert not sent.done()
    sent.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sent


async def leave_a_pool_request(gateway, client) -> dict[str, int]:
    """``long_answer`` to the pool, left once its engine generated a few tokens; returns the
    engines' totals from before it."""
    before = engine_totals(gateway)

    def generating() -> bool:
        return engine_totals(gateway)["completion_tokens"] - before["completion_tokens"] >= 5

    await leave_mid_generation(client, long_answer(), generating)
    return before


async def alpha_today(gateway):
    """Alpha's row in the ledger today, every record written."""
    await gateway.ledger.flush()
    today = dt.datetime.now(dt.UTC).date()
    (row,) = await gateway.ledger.read(["alpha"], today, today, by_day=False)
    return row


async def booked_once_aborted(gateway, before: dict[str, int]):
    """Alpha's row once the engine aborted the generation, and what the engines spent since
    ``before``."""
    await eventually_async(
        lambda: engine_totals(gateway)["running"] == 0,
        timeout_s=5,
        what="the engine to have aborted the generation",
    )
    row = await alpha_today(gateway)
    after = engine_totals(gateway)
    return row, {k: after[k] - before[k] for k in ("prompt_tokens", "completion_tokens")}


async def test_a_non_streamed_request_cancelled_mid_generation_is_charged_the_engines_count(
    monkeypatch,
):
    """It was charged nothing, though the engine had spent a prompt and some tokens on it (a
    stream left mid-way was already charged exactly: ``test_metering`` end to end)."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    gateway = slow_pool_gateway()
    async with gateway.lifespan(), http(gateway) as client:
        before = await leave_a_pool_request(gateway, client)
        row, spent = await booked_once_aborted(gateway, before)
    assert 5 <= spent["completion_tokens"] < 2000
    assert row.counts.get("estimated_requests", 0) == 0, row.counts
    assert row.counts["prompt_tokens"] == spent["prompt_tokens"], (row.counts, spent)
    assert row.counts["completion_tokens"] == spent["completion_tokens"], (row.counts, spent)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streamed", "streamed"])
async def test_a_request_its_own_deadline_ended_is_charged_and_counted_as_the_clients_doing(
    monkeypatch, stream
):
    """``x-request-timeout`` ran out mid-generation: the client sees a 504 (streamed: an SSE error
    event after its first tokens). It is charged the engine's work, as when the client leaves
    (it was charged nothing before its first byte, so a deadline just short of the answer got
    the engine's work free), and counted as the client's doing, a 499, as leaving is: it was a
    504 in the error ratio, or a backend's truncated stream (599) when streamed."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    metrics = RecordingMetrics()
    gateway = slow_pool_gateway(metrics)
    async with gateway.lifespan(), http(gateway) as client:
        before = engine_totals(gateway)
        response = await client.post(
            "/v1/chat/completions",
            json={**long_answer(), "stream": stream},  # 2,000 tokens of 5 ms: past the deadline
            headers={"authorization": f"Bearer {KEY}", "x-request-timeout": "0.5"},
        )
        if stream:
            assert response.status_code == 200, response.text
            *answered, last = [json.loads(line[6:]) for line in response.text.split("\n\n") if line]
            assert answered and all("choices" in frame for frame in answered)
            assert last["error"]["code"] == "client_deadline_exceeded", last
        else:
            assert response.status_code == 504, response.text
            assert response.json()["error"]["code"] == "client_deadline_exceeded"
        row, spent = await booked_once_aborted(gateway, before)
    assert 0 < spent["completion_tokens"] < 2000
    assert row.counts.get("estimated_requests", 0) == 0, row.counts
    assert row.counts["prompt_tokens"] == spent["prompt_tokens"], (row.counts, spent)
    assert row.counts["completion_tokens"] == spent["completion_tokens"], (row.counts, spent)
    errors = {k: v for k, v in row.counts.items() if k.startswith("errors_")}
    assert errors == {"errors_disconnected": 1}, row.counts
    assert [r["status"] for r in metrics.recorded] == [499]


async def test_a_non_streamed_request_the_fallback_was_answering_is_charged_an_estimate(
    monkeypatch,
):
    """The fallback bills the prompt it was sent, and no replica can say what it spent: the
    tenant is charged the gateway's estimate of the prompt, flagged as estimated (it was
    charged nothing)."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    # Still generating when the client leaves: 2,000 tokens of 5 ms each.
    slow = {**FAST, "decode_base_s": 0.005, "output_tokens_min": 2000, "output_tokens_max": 2000}
    upstream = httpx.ASGITransport(create_mock_app("mock-gemini", slow, api_key=UPSTREAM_KEY))
    gateway = build_local_gateway(load_config(forge_args()), fallback_transport=upstream)
    async with gateway.lifespan(), http(gateway) as client:
        # Well into its 2,000 tokens of 5 ms each: no replica to watch, so a while.
        clock = asyncio.get_running_loop().time
        started = clock()
        await leave_mid_generation(
            client, long_answer("mock-gemini"), lambda: clock() - started >= 0.3
        )
        row = await alpha_today(gateway)
    assert row.counts["fallback_requests"] == 1, row.counts
    assert row.counts["estimated_requests"] == 1, row.counts
    assert row.counts["prompt_tokens"] > 0, row.counts
    assert row.counts.get("completion_tokens", 0) == 0, row.counts


async def test_a_request_whose_replica_cannot_say_what_it_cost_is_charged_an_estimate(
    monkeypatch,
):
    """A replica gone, or too slow to answer the question in time (a loaded machine): the
    tenant is charged the gateway's estimate of the prompt, flagged, not nothing."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    gateway = slow_pool_gateway()
    pool = gateway.backends["primary"]

    async def unanswered(request_id: str, replica_id: str) -> None:
        return None  # what ``PoolBackend.abandoned_usage`` says when the replica is late

    monkeypatch.setattr(pool, "abandoned_usage", unanswered)
    async with gateway.lifespan(), http(gateway) as client:
        await leave_a_pool_request(gateway, client)
        row = await alpha_today(gateway)
    assert row.counts["estimated_requests"] == 1, row.counts
    assert row.counts["prompt_tokens"] > 0, row.counts


def routed_unheard(pool, taken_second: bool = True):
    """The pool's routing as Serve's router leaves it for a request cancelled after Serve sent
    it but before the replica's word that it took it came back: every replica offered, best
    first, and none noted as the one that took it (``PoolBridge.offered``). The replica that
    took it is offered second, so a replica it never reached is asked first."""

    def offered_only(bridge, request_id: str, replica_id: str, probe: bool) -> None:
        others = tuple(sorted(set(pool.replicas) - {replica_id}))
        bridge.note_offered(request_id, (*others, replica_id) if taken_second else others)

    return offered_only


async def test_a_request_left_before_serve_heard_which_replica_took_it_is_charged_its_cost(
    monkeypatch,
):
    """The end-to-end metering test, on two busy cores, once charged nothing for a request
    whose engine had prefilled its prompt: the client left in that window. The replicas it
    was offered are asked, and the one that ran it says what it cost."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    gateway = slow_pool_gateway()
    pool = gateway.backends["primary"]
    monkeypatch.setattr(type(pool.bridge), "note_routed", routed_unheard(pool))
    async with gateway.lifespan(), http(gateway) as client:
        before = await leave_a_pool_request(gateway, client)
        row = await alpha_today(gateway)
        after = engine_totals(gateway)
    spent = {k: after[k] - before[k] for k in ("prompt_tokens", "completion_tokens")}
    assert spent["completion_tokens"] >= 5
    assert row.counts.get("estimated_requests", 0) == 0, row.counts
    assert row.counts["prompt_tokens"] == spent["prompt_tokens"], (row.counts, spent)
    assert row.counts["completion_tokens"] == spent["completion_tokens"], (row.counts, spent)
    assert not pool.bridge.offered, "the guess outlived the request"


async def test_a_request_left_before_any_offered_replica_got_it_is_charged_nothing(monkeypatch):
    """Offered, but never reached the replicas asked (still in Serve's queue): nothing ran
    there, so nothing is charged, and it is not an estimate either."""
    monkeypatch.setenv(KEY_ENV, UPSTREAM_KEY)
    gateway = slow_pool_gateway()
    pool = gateway.backends["primary"]
    monkeypatch.setattr(type(pool.bridge), "note_routed", routed_unheard(pool, False))
    taken = {}
    ask = pool.abandoned_usage

    async def asked(request_id: str, replica_id: str, **options) -> dict | None:
        taken[replica_id] = await ask(request_id, replica_id, **options)
        return taken[replica_id]

    monkeypatch.setattr(pool, "abandoned_usage", asked)
    async with gateway.lifespan(), http(gateway) as client:
        await leave_a_pool_request(gateway, client)
        row = await alpha_today(gateway)
    assert taken and set(taken.values()) == {None}, taken  # the other replica was asked
    assert row.counts.get("estimated_requests", 0) == 0, row.counts
    assert row.counts.get("prompt_tokens", 0) == 0, row.counts
