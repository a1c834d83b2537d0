"""Live configuration: the gateway's ``user_config`` changes tenants, keys, limits, admission and
breaker settings in a running gateway (``Gateway.reconfigure``, which Serve calls), atomically per
request; a bad change is refused with its field's path and the old configuration keeps serving.
In process (``serve_app/local.py``): real replicas, scheduler, board and store. Through Serve, with
``serve deploy``: ``loadtest/rollout.py`` and its slow test."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from serve_app.admission.scheduler import FairScheduler, TenantShare
from serve_app.auth.keys import hash_key
from serve_app.config.live import apply_live
from serve_app.config.models import ConfigError, load_config
from serve_app.gateway.server import Gateway
from serve_app.local import build_local_gateway
from serve_app.resilience.board import BreakerBoard
from serve_app.store import MemoryStore
from tests.doubles import Clock
from tests.polling import eventually_async

OLD_KEY, NEW_KEY, TEAM_KEY = "sk-test-live-old", "sk-test-live-new", "sk-test-live-team"
ADMIN_KEY = "sk-test-live-admin"
MODEL = "forge-sim"
# Slow enough for a stream to be under way while the configuration changes.
ENGINE = {"prefill_base_s": 0.0, "decode_base_s": 0.02, "output_tokens_min": 8}


def alpha(**limits) -> dict:
    return {"name": "alpha", "key_hashes": [hash_key(OLD_KEY)], "limits": limits}


def args() -> dict:
    return {
        "tenants": [alpha(rpm=1, burst_requests=1)],
        "admin": {"key_hashes": [hash_key(ADMIN_KEY)]},
        "pools": [
            {
                "name": "primary",
                "model": MODEL,
                "engine": ENGINE,
                "admission": {"max_inflight": 2},
            }
        ],
    }


@pytest.fixture
async def board() -> BreakerBoard:
    return BreakerBoard()


@pytest.fixture
async def gateway(board) -> AsyncIterator[Gateway]:
    gateway = build_local_gateway(load_config(args()), board=board)
    async with gateway.lifespan():
        yield gateway


def client(gateway: Gateway) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(gateway.asgi_app())
    return httpx.AsyncClient(transport=transport, base_url="http://forge.test")


@pytest.fixture
async def http(gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with client(gateway) as http:
        yield http


async def ask(http: httpx.AsyncClient, key: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = await http.post(
        "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    )
    return response.status_code


@pytest.mark.parametrize(
    ("user_config", "path"),
    [
        ({"tenants": [alpha(rpm=0)]}, "tenants.0.limits.rpm"),
        ({"tenants": [{"name": "alpha", "weight": -1, "key_hashes": []}]}, "tenants.0.weight"),
        ({"admission": {"primary": {"max_inflight": 0}}}, "admission.primary.max_inflight"),
        ({"admission": {"nope": {"max_inflight": 1}}}, "admission.nope"),
        ({"pools": []}, "pools: not a live setting"),
        ({"tenants": []}, "tenants: at least one tenant"),
        # Cross-field: one key for two tenants.
        ({"tenants": [alpha(), {**alpha(), "name": "beta"}]}, "one key hash is listed for two"),
    ],
)
def test_a_bad_live_config_names_its_field(user_config: dict, path: str):
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        apply_live(load_config(args()), user_config)


def test_live_sections_replace_the_args_ones_and_leave_the_rest():
    base = load_config(args())
    live = apply_live(
        base, {"tenants": [alpha(rpm=100)], "admission": {"primary": {"max_inflight": 5}}}
    )
    assert live.tenants[0].limits.rpm == 100
    assert live.pools[0].admission.max_inflight == 5
    assert live.pools[0].engine == base.pools[0].engine
    assert apply_live(base, None) is base


async def test_a_new_tenant_and_a_raised_limit_apply_to_the_next_request(board):
    clock = Clock(1000.0)  # the store's: the bucket refills only when the test says
    gateway = build_local_gateway(load_config(args()), board=board, store=MemoryStore(clock=clock))
    async with gateway.lifespan(), client(gateway) as http:
        assert await ask(http, OLD_KEY) == 200
        assert await ask(http, OLD_KEY) == 429  # rpm 1
        assert await ask(http, TEAM_KEY) == 401
        team = {"name": "team", "key_hashes": [hash_key(TEAM_KEY)]}
        await gateway.reconfigure({"tenants": [alpha(rpm=1000), team]})
        assert await ask(http, TEAM_KEY) == 200
        # Its fill level stays in the store (not reset): still empty until it refills, at the
        # new rate: 0.1 s is 1.7 requests' worth at 1000 a minute (and 1/600th of one at 1).
        assert await ask(http, OLD_KEY) == 429
        clock.advance(0.1)
        assert await ask(http, OLD_KEY) == 200
        assert gateway.live.status["refused"] is None


async def test_a_stream_under_way_finishes_under_the_configuration_it_started_with(gateway, http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    headers = {"authorization": f"Bearer {OLD_KEY}"}
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as stream:
        assert stream.status_code == 200
        chunks = stream.aiter_text()
        first = await anext(chunks)
        # alpha's key is withdrawn while its stream runs.
        await gateway.reconfigure(
            {"tenants": [{"name": "team", "key_hashes": [hash_key(TEAM_KEY)]}]}
        )
        rest = "".join([chunk async for chunk in chunks])
    assert (first + rest).rstrip().endswith("data: [DONE]")
    assert await ask(http, OLD_KEY) == 401
    assert await ask(http, TEAM_KEY) == 200


async def test_a_rotated_key_keeps_working_across_changes_until_it_is_withdrawn(gateway, http):
    both = {**alpha(rpm=1000), "key_hashes": [hash_key(OLD_KEY), hash_key(NEW_KEY)]}
    await gateway.reconfigure({"tenants": [both]})
    assert [await ask(http, OLD_KEY), await ask(http, NEW_KEY)] == [200, 200]
    await gateway.reconfigure({"tenants": [{**both, "weight": 3}]})  # another change meanwhile
    assert [await ask(http, OLD_KEY), await ask(http, NEW_KEY)] == [200, 200]
    await gateway.reconfigure({"tenants": [{**both, "key_hashes": [hash_key(NEW_KEY)]}]})
    assert [await ask(http, OLD_KEY), await ask(http, NEW_KEY)] == [401, 200]


async def test_a_bad_change_is_refused_and_the_running_configuration_kept(gateway, http):
    await gateway.reconfigure({"tenants": [alpha(rpm=1000)]})
    applied = gateway.live.status["digest"]
    await gateway.reconfigure({"tenants": [alpha(rpm=-5)]})  # no exception: Serve would restart
    assert gateway.live.status["digest"] == applied
    assert "tenants.0.limits.rpm" in gateway.live.status["refused"]["error"]
    assert gateway.config.tenants[0].limits.rpm == 1000
    assert [await ask(http, OLD_KEY) for _ in range(3)] == [200, 200, 200]
    status = await http.get("/admin/status", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert status.json()["config"]["digest"] == applied
    assert "tenants.0.limits.rpm" in status.json()["config"]["refused"]["error"]


async def test_a_bad_user_config_at_start_fails_the_replica_with_its_path(board):
    gateway = build_local_gateway(load_config(args()), board=board)
    with pytest.raises(ConfigError, match=r"tenants\.0\.limits\.rpm"):
        await gateway.reconfigure({"tenants": [alpha(rpm=0)]})


async def test_admission_weights_and_breaker_settings_reach_the_scheduler_and_board(gateway, board):
    scheduler = gateway.schedulers["primary"].scheduler
    breaker = board.breaker("primary")  # an existing breaker takes the new settings too
    await gateway.reconfigure(
        {
            "tenants": [{**alpha(), "weight": 3, "tier": "batch"}],
            "admission": {"primary": {"max_inflight": 5, "max_tenant_share": 0.6}},
            "resilience": {
                "breaker": {"failure_threshold": 2, "cooldown_s": 42},
                "retry_budget": {"min_retries": 2},
            },
        }
    )

    def delivered() -> bool:
        share = scheduler.tenant_config("alpha")
        return (
            scheduler.max_inflight == 5
            and share.weight == 3
            and share.tier == "batch"
            and board.settings.cooldown_s == 42
        )

    await eventually_async(delivered, timeout_s=5, what="the settings at the scheduler and board")
    assert breaker.settings.failure_threshold == 2
    # This replica's own slots of the pool follow the new per-tenant cap: 60 % of 5.
    assert gateway.lasting.slots["primary"].tenant_cap == 3


async def test_a_larger_slot_budget_grants_waiters_at_once_and_a_smaller_revokes_nothing():
    scheduler = FairScheduler(1, tenants={"a": TenantShare(queue_cap=4)})
    held = await scheduler.acquire("a", deadline_s=5)
    waiting = asyncio.ensure_future(scheduler.acquire("a", deadline_s=5))
    await asyncio.sleep(0)
    assert not waiting.done()
    scheduler.reconfigure(2, tenants={"a": TenantShare(queue_cap=4)})
    granted = await asyncio.wait_for(waiting, 1)
    assert scheduler.slots_used == 2
    scheduler.reconfigure(1)  # both leases stay until released
    assert scheduler.slots_used == 2
    assert scheduler.release(held.lease_id) and scheduler.release(granted.lease_id)
    with pytest.raises(ValueError, match="max_inflight"):
        scheduler.reconfigure(0)
    assert scheduler.max_inflight == 1
