"""The books drill's judging, without Ray: the fault plan, the windows, the documented budget
bound, and claim 1's arithmetic (``loadtest/books.py``; CI runs the drill itself,
``python -m loadtest.books --quick --check``)."""

from __future__ import annotations

import itertools

import pytest

from loadtest import books
from loadtest.traffic import Result


def result(stream: str, start: float, status: int = 200, total: float = 0.2, **kw) -> Result:
    fields = {"prompt_tokens": None, "completion_tokens": None, "error": None} | kw
    return Result(
        stream, start, status, "primary", None, None, None, total,
        fields["prompt_tokens"], fields["completion_tokens"], False, fields["error"],
    )  # fmt: skip


def test_the_plan_does_each_fault_in_turn_with_windows_apart():
    plan = books.fault_plan(books.FAULT_KINDS, 2, 240, outage_s=6, after_s=5, lead_s=8)
    assert [f.kind for f in plan] == list(books.FAULT_KINDS) * 2
    assert plan[0].at_s == 8
    windows = books.windows_of(plan, after_s=5, calm_from_s=3)
    assert windows[0].kind == "calm" and windows[0].end_s < plan[0].at_s
    for before, after in itertools.pairwise(windows[1:]):
        assert before.end_s < after.start_s, (before, after)
    assert windows[-1].end_s <= 240 - 2
    assert {f.lasts_s for f in plan if f.kind in books.OUTAGES} == {6}
    assert {f.lasts_s for f in plan if f.kind not in books.OUTAGES} == {0}


def test_a_plan_that_does_not_fit_says_so():
    with pytest.raises(ValueError, match="more --minutes"):
        books.fault_plan(books.FAULT_KINDS, 5, 60, outage_s=6, after_s=5, lead_s=8)


def test_the_documented_bound_is_the_local_shares_and_a_burst_when_redis_comes_back_empty():
    limits = books.budget_limits(books.flood_tenants(2), gateways=2)
    rpm = next(lim for lim in limits if lim.unit == "requests")
    assert (rpm.burst, rpm.per_s, rpm.share_burst) == (6, 1.0, 3)

    def bound(kind: str, failures: int | None = 0) -> float:
        return books.documented_extra(rpm, books.Window(kind, kind, 0, 10, failures), 2)

    assert bound("redis-pause") == bound("redis-restart") == 6  # two fresh shares of 3
    assert bound("redis-kill") == 12  # and a second behind: the burst again
    assert bound("redis-flush") == 6  # back empty, never unreachable
    assert bound("gateway-kill") == bound("calm") == 0
    assert bound("calm", failures=1) == 6  # a reserve failed: a local share was used


def test_overshoot_counts_what_a_tenant_was_served_beyond_one_bucket():
    tenants = books.flood_tenants(2)
    limits = books.budget_limits(tenants, gateways=2)
    streams = {e.name: e.tenant for e in books.floods(tenants)}
    shapes = {e.name: books._shape(e) for e in books.floods(tenants)}
    name = next(n for n, t in streams.items() if t.startswith("flood-rpm"))
    window = books.Window("redis-pause #1", "redis-pause", 10, 20, 3)
    served = [result(name, 10 + i * 0.5, prompt_tokens=48, completion_tokens=32) for i in range(20)]
    refused = [result(name, 12.1, 429, error="http_429:requests")]
    rows = books.overshoots(served + refused, [window], limits, 2, streams, shapes)
    row = next(r for r in rows if r.tenant == streams[name] and r.unit == "requests")
    # 20 served against 6 + 1/s over 10 s (+1 s of admission slack): 3 over, bound 6.
    assert (row.served, row.budget, row.bound, row.slack) == (20, 17, 6, 0)
    assert row.ok
    many = [result(name, 10 + i * 0.2, prompt_tokens=48, completion_tokens=32) for i in range(40)]
    assert not next(
        r
        for r in books.overshoots(many, [window], limits, 2, streams, shapes)
        if r.unit == "requests"
    ).ok


def test_a_completion_reserves_exactly_what_it_is_charged():
    shape = books._shape(books.floods(books.flood_tenants(2))[1])
    assert (
        books._reservation_gap(result("f", 0, prompt_tokens=48, completion_tokens=32), shape) == 0
    )
    assert books._reservation_gap(result("f", 0, 503, error="http_503"), shape) == 80


def _books(
    engine_gap: int, kills: list[dict], sent: int = 100, counted: int = 100, journal: bool = False
):
    pools = {
        pool: {
            "model": model,
            "ledger_prompt": 1000,
            "ledger_completion": 500,
            "engine_prompt": 1000 + (engine_gap if pool == "primary" else 0),
            "engine_completion": 500,
            "estimated_requests": 0,
            "requests": 50,
            "replicas_same": True,
        }
        for pool, model in books.POOLS.items()
    }
    return books.LedgerBooks(pools, {}, sent, counted, 0, kills, 1.0, books.max_charge(), journal)


def test_without_a_gateway_kill_the_ledger_must_equal_the_engines():
    assert books.check_ledger(_books(0, [])).ok
    assert not books.check_ledger(_books(1, [])).ok
    assert not books.check_ledger(_books(0, [], counted=99)).ok


def test_without_a_journal_a_killed_gateway_may_lose_what_it_held_and_what_was_cut_on_it():
    held = {
        "queued": {"requests": 2, "prompt_tokens": 100},
        "queued_by_model": {books.MODEL: {"requests": 2, "prompt_tokens": 100}},
        "settles_pending": 0,
    }
    kill = {"at_s": 10.0, "replica": "r", "held": held, "cut": 1, "cut_by_error": {}, "recent": 5}
    prompt_max, _ = books.max_charge()
    assert books.check_ledger(_books(100 + prompt_max, [kill], counted=97)).ok
    assert not books.check_ledger(_books(100 + prompt_max + 1, [kill], counted=97)).ok
    # A fourth lost: it ended whole before the kill, its record not yet queued; that and the
    # two held are within the 5 requests that ended in the flush period before the kill.
    assert books.check_ledger(_books(0, [kill], counted=96)).ok
    assert not books.check_ledger(_books(0, [{**kill, "recent": 2}], counted=96)).ok
    # More unwritten than the flush period's requests: past the documented loss.
    assert not books.check_ledger(_books(100, [{**kill, "recent": 1}], counted=98)).ok


def test_with_a_journal_what_a_killed_gateway_held_must_reach_the_ledger():
    held = {
        "queued": {"requests": 2, "prompt_tokens": 100},
        "queued_by_model": {books.MODEL: {"requests": 2, "prompt_tokens": 100}},
        "settles_pending": 0,
    }
    kill = {
        "at_s": 10.0,
        "replica": "r",
        "held": held,
        "cut": 1,
        "cut_by_error": {},
        "recent": 5,
        "instant": 1,
    }
    prompt_max, _ = books.max_charge()
    # Missing: the cut one and one that ended whole in the last instant; the held are written.
    assert books.check_ledger(_books(prompt_max, [kill], counted=98, journal=True)).ok
    # Two held records missing too: fine without a journal, a journal not adopted with one.
    assert books.check_ledger(_books(100 + prompt_max, [kill], counted=96)).ok
    assert not books.check_ledger(_books(100 + prompt_max, [kill], counted=96, journal=True)).ok
