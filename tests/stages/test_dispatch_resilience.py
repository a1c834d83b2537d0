"""Dispatch with breakers and the retry budget: route around the known dead, retry once."""

from __future__ import annotations

import pytest

from serve_app import errors
from serve_app.errors import ForgeError
from serve_app.resilience.board import BreakerBoard
from serve_app.resilience.breaker import Admit, BreakerSettings, State
from serve_app.resilience.client import BreakerClient
from serve_app.resilience.retry_budget import RetryBudget, RetryBudgetSettings
from serve_app.stages.dispatch import Dispatch
from tests.doubles import MODEL, Clock, FakeBackend, body_of, chunk, make_ctx

SETTINGS = BreakerSettings(failure_threshold=3, cooldown_s=5, min_requests=100)


def rig(primary: FakeBackend, fallback: FakeBackend | None, *, min_retries: int = 100):
    clock = Clock()
    board = BreakerBoard(SETTINGS, clock)
    client = BreakerClient(board, sync_interval_s=60, clock=clock)
    budget = RetryBudget(RetryBudgetSettings(ratio=0.1, window_s=10, min_retries=min_retries))
    backends = [primary] + ([fallback] if fallback else [])
    return Dispatch({MODEL: backends}, client, budget), client, clock


def dead(name: str) -> FakeBackend:
    return FakeBackend(name, fail_before=errors.bad_gateway("replica went away"))


async def test_after_enough_failures_the_dead_primary_is_not_even_tried():
    primary, fallback = dead("primary"), FakeBackend("fallback", [[chunk("ok")]])
    dispatch, client, _ = rig(primary, fallback)
    for _ in range(3):
        response = await dispatch(make_ctx())
        assert response.headers["x-forge-backend"] == "fallback"
        await body_of(response)
    await client.flush()
    assert client.state("primary") is State.OPEN
    for _ in range(10):
        response = await dispatch(make_ctx())
        await body_of(response)
    assert len(primary.calls) == 3  # the 10 later requests routed around it for free


async def test_after_the_cooldown_one_request_probes_and_its_success_brings_traffic_home():
    primary, fallback = dead("primary"), FakeBackend("fallback", [[chunk("ok")]])
    dispatch, client, clock = rig(primary, fallback)
    for _ in range(3):
        await body_of(await dispatch(make_ctx()))
    await client.flush()
    primary.fail_before = None  # it comes back
    primary.batches = [[chunk("home")]]
    clock.now = 6
    served = []
    for _ in range(5):
        response = await dispatch(make_ctx())
        served.append(response.headers["x-forge-backend"])
        await body_of(response)
        await client.flush()
    assert served == ["primary"] * 5
    assert client.state("primary") is State.CLOSED


async def test_a_probe_that_fails_is_retried_on_the_fallback_and_reopens_the_breaker():
    primary, fallback = dead("primary"), FakeBackend("fallback", [[chunk("ok")]])
    dispatch, client, clock = rig(primary, fallback)
    for _ in range(3):
        await body_of(await dispatch(make_ctx()))
    await client.flush()
    clock.now = 6
    response = await dispatch(make_ctx())
    assert response.headers["x-forge-backend"] == "fallback"
    await client.flush()
    assert client.state("primary") is State.OPEN and len(primary.calls) == 4


async def test_a_failed_probe_is_retried_on_the_fallback_even_with_the_budget_spent():
    """The budget went on the outage's first failures; the probe 5 s later still fails over:
    one probe per cool-down cannot make a retry storm, and its client should not see a 502."""
    primary, fallback = dead("primary"), FakeBackend("fallback", [[chunk("ok")]])
    dispatch, client, clock = rig(primary, fallback, min_retries=3)
    for _ in range(3):  # the three failures that open the breaker spend the whole budget
        await body_of(await dispatch(make_ctx()))
    await client.flush()
    assert dispatch.budget.allowed(clock.now) - dispatch.budget.used(clock.now) <= 0
    clock.now = 6  # half-open: this request is the probe
    response = await dispatch(make_ctx())
    assert response.headers["x-forge-backend"] == "fallback"
    assert len(primary.calls) == 4, "the probe went to the primary first"


async def test_the_retry_budget_caps_retries_and_the_client_sees_the_first_failure():
    primary, fallback = dead("primary"), FakeBackend("fallback", [[chunk("ok")]])
    dispatch, _, _ = rig(primary, fallback, min_retries=1)
    assert (await dispatch(make_ctx())).headers["x-forge-backend"] == "fallback"
    with pytest.raises(ForgeError) as info:
        await dispatch(make_ctx())
    assert info.value.status == 502 and len(fallback.calls) == 1


async def test_a_4xx_is_neither_retried_nor_a_breaker_failure():
    primary = FakeBackend(
        "primary", fail_before=ForgeError(400, "too long", type="invalid_request_error")
    )
    fallback = FakeBackend("fallback", [[chunk("ok")]])
    dispatch, client, _ = rig(primary, fallback)
    for _ in range(5):
        with pytest.raises(ForgeError):
            await dispatch(make_ctx())
    await client.flush()
    assert fallback.calls == [] and client.state("primary") is State.CLOSED


async def test_with_every_backend_open_the_answer_is_a_fast_503_with_retry_after():
    primary, fallback = dead("primary"), dead("fallback")
    dispatch, client, _ = rig(primary, fallback)
    for _ in range(3):
        with pytest.raises(ForgeError):
            await dispatch(make_ctx())
    await client.flush()
    calls = len(primary.calls) + len(fallback.calls)
    with pytest.raises(ForgeError) as info:
        await dispatch(make_ctx())
    assert info.value.status == 503 and int(info.value.headers["retry-after"]) >= 1
    assert len(primary.calls) + len(fallback.calls) == calls


async def test_without_a_fallback_the_one_retry_goes_to_the_same_pool():
    primary = dead("primary")
    dispatch, _, _ = rig(primary, None)
    with pytest.raises(ForgeError):
        await dispatch(make_ctx(stream=False))
    assert len(primary.calls) == 2  # never more than one retry


async def test_a_failure_after_the_first_byte_is_never_retried():
    primary = FakeBackend(
        "primary", [[chunk("half")]], fail_after=errors.bad_gateway("died mid-stream")
    )
    fallback = FakeBackend("fallback", [[chunk("ok")]])
    dispatch, _, _ = rig(primary, fallback)
    parts = await body_of(await dispatch(make_ctx()))
    assert b"died mid-stream" in parts[-1] and fallback.calls == []


async def test_the_client_timeout_reaches_the_backend_as_its_budget():
    seen = []

    class Recording(FakeBackend):
        async def complete(self, body, kind, request_id, budget_s=None):
            seen.append(budget_s)
            return await super().complete(body, kind, request_id)

    dispatch, _, _ = rig(Recording("primary"), None)
    ctx = make_ctx(stream=False)
    ctx.client_timeout_s = 7.0
    await dispatch(ctx)
    assert seen and 6 < seen[0] <= 7


async def test_a_probe_granted_to_a_retry_the_budget_refuses_is_handed_back():
    """Pool fails, fallback's breaker is half-open, no budget left: the fallback's probe was
    granted but never used, and must not stay out (the next request may probe at once)."""
    primary, fallback = dead("primary"), FakeBackend("fallback", [[chunk("ok")]])
    dispatch, client, clock = rig(primary, fallback, min_retries=0)
    client.trip("fallback")
    await client.flush()
    clock.now = 6  # the fallback's cool-down is over
    with pytest.raises(ForgeError):
        await dispatch(make_ctx())  # the pool fails; the retry is refused by the budget
    await client.flush()
    assert fallback.calls == []
    assert await client.admit("fallback") is Admit.PROBE


async def test_a_request_the_fallback_does_not_serve_is_not_failed_over_to_it():
    primary, fallback = dead("primary"), FakeBackend("fallback", [[chunk("ok")]])
    fallback.kinds = ("chat",)  # Gemini: no /v1/completions
    dispatch, _, _ = rig(primary, fallback)
    ctx = make_ctx()
    ctx.route = "completion"
    with pytest.raises(ForgeError) as info:
        await dispatch(ctx)
    # The pool's own failure (retried on the pool), never the upstream's 404.
    assert info.value.status == 502 and fallback.calls == [] and len(primary.calls) == 2
    response = await dispatch(make_ctx())  # a chat request still fails over
    assert response.headers["x-forge-backend"] == "fallback"


async def test_the_fallbacks_own_model_on_a_route_it_lacks_is_a_named_400():
    fallback = FakeBackend("fallback", [[chunk("ok")]])
    fallback.kinds = ("chat",)
    dispatch = Dispatch({MODEL: [fallback]}, None, None)
    ctx = make_ctx()
    ctx.route = "completion"
    with pytest.raises(ForgeError) as info:
        await dispatch(ctx)
    assert info.value.status == 400 and "/v1/completions" in info.value.message
    assert fallback.calls == []
