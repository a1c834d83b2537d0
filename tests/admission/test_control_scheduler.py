"""A control application's scheduler: it starts with no settings and takes the gateways'; the
gateway side sends them when it meets one that has none, and its leases come back on renewal
(one batched ``sync`` for all of a gateway replica's leases).

The deployment class is driven through a stand-in for its Serve handle that calls it in this
process (what crosses is pickled, as a handle would), so what is tested is the seam the gateway
uses, without a cluster. ``tests/e2e/test_control_app.py`` runs the same through Serve.
"""

from __future__ import annotations

import inspect
import pickle

import pytest

from serve_app.admission.client import ServeSchedulerClient, Unconfigured
from serve_app.admission.deployment import SchedulerDeployment
from serve_app.admission.scheduler import Shed
from serve_app.admission.warm_slots import WarmSlots

ADMISSION = {"max_inflight": 1, "deadline_s": 0.2, "keep_warm_s": 0}
TENANTS = [{"name": "alpha", "key_hashes": ["a" * 64]}]


class InProcessHandle:
    """``handle.method.remote(*args)`` on an object here, arguments and errors pickled."""

    def __init__(self, target: object) -> None:
        self.target = target  # swapped for a new one: the scheduler restarted
        self.called: list[str] = []

    def __getattr__(self, method: str):
        target, called = self.target, self.called

        class _Method:
            async def remote(self, *args):
                called.append(method)
                try:
                    result = getattr(target, method)(*pickle.loads(pickle.dumps(args)))
                    if hasattr(result, "__await__"):
                        result = await result
                except Exception as exc:
                    raise pickle.loads(pickle.dumps(exc)) from None
                return pickle.loads(pickle.dumps(result))

        return _Method()


async def test_an_unconfigured_scheduler_is_sent_the_settings_by_its_first_caller():
    scheduler = SchedulerDeployment("primary")  # as build_control binds it: no settings
    with pytest.raises(Unconfigured):
        await scheduler.acquire("alpha", None)

    asked: list[str] = []

    def settings() -> tuple[dict, list[dict]]:
        asked.append("settings")
        return ADMISSION, TENANTS

    client = ServeSchedulerClient(InProcessHandle(scheduler), settings)
    lease = await client.acquire("alpha", None)
    assert asked == ["settings"]
    snapshot = await scheduler.snapshot()
    assert snapshot["slots_total"] == 1 and snapshot["slots_used"] == 1
    renewal = await client.sync([("renew", lease.lease_id, "alpha", "interactive")])
    assert renewal.lost == ()
    assert asked == ["settings"], "a configured scheduler is not sent them again"


async def test_a_client_without_settings_lets_unconfigured_through():
    client = ServeSchedulerClient(InProcessHandle(SchedulerDeployment("primary")))
    with pytest.raises(Unconfigured):
        await client.acquire("alpha", None)


async def test_a_restarted_scheduler_learns_every_live_lease_from_one_batched_renewal():
    handle = InProcessHandle(
        SchedulerDeployment("primary", ADMISSION | {"max_inflight": 3}, TENANTS)
    )
    settings = (ADMISSION | {"max_inflight": 3}, TENANTS)
    gateway = WarmSlots(ServeSchedulerClient(handle, lambda: settings), tenant_cap=3, keep_warm_s=0)
    leases = [await gateway.acquire("alpha", tier) for tier in ("interactive", "batch", "batch")]
    for lease in leases:
        gateway.keep_alive(lease.lease_id, max_life_s=300)
    gateway.release(leases[0].lease_id)  # ended before the restart; its release not yet sent

    restarted = SchedulerDeployment("primary")  # knows no lease, and no settings yet
    handle.target, handle.called = restarted, []
    await gateway.renew_now()
    assert handle.called == ["sync", "configure", "sync"], "one batch (sent again once set up)"
    snapshot = await restarted.snapshot()
    assert snapshot["slots_used"] == 2 and snapshot["inflight"] == {"alpha": 2}
    assert snapshot["adopted_leases"] == 2, "the live ones; the released one stays released"
    with pytest.raises(Shed) as shed:  # one slot free: a newcomer takes it, the next waits
        await gateway.acquire("alpha", "interactive")
        await gateway.acquire("alpha", "interactive")
    assert shed.value.reason == "deadline"


def test_every_method_a_handle_calls_runs_on_the_replicas_event_loop():
    """Serve runs a replica's plain (non-async) methods in a thread pool, beside the event loop
    that runs ``acquire``: a ``sync`` there releasing a slot raced an ``acquire`` granting one,
    and the e2e slot budget saw the scheduler hold 9 leases of 8."""
    called = [
        name
        for name, method in inspect.getmembers(SchedulerDeployment, inspect.isfunction)
        if not name.startswith("_")
    ]
    assert {"acquire", "sync", "renew", "snapshot"} <= set(called)  # renew: earlier gateways
    plain = [
        name
        for name in called
        if not inspect.iscoroutinefunction(SchedulerDeployment.__dict__[name])
    ]
    assert plain == [], f"these would run off the event loop: {plain}"


async def test_a_refusal_crosses_the_handle_as_a_value_and_is_raised_on_the_gateway_side():
    """Serve logs every exception that leaves a replica, traceback formatted, and the caller
    rebuilds it as a ``RayTaskError``: under a flood of 429s that was half the scheduler's busy
    CPU. The replica returns the refusal; the gateway's client raises it, fields intact."""
    scheduler = SchedulerDeployment("primary", ADMISSION | {"queue_cap": 0}, TENANTS)
    await scheduler.acquire("alpha", None)  # the one slot
    refusal = await scheduler.acquire("alpha", None)
    assert isinstance(refusal, Shed) and refusal.reason == "queue_full"

    client = ServeSchedulerClient(InProcessHandle(scheduler))
    with pytest.raises(Shed) as shed:
        await client.acquire("alpha", None)
    assert (shed.value.reason, shed.value.tenant) == ("queue_full", "alpha")
    assert shed.value.retry_after_s > 0


def test_the_control_application_writes_no_access_line_per_gateway_call():
    """A gateway calls its scheduler once or more per request: Serve's access line for each
    was 15 % of the scheduler's busy CPU under a flood. Errors are logged all the same."""
    from serve_app.app import build_control

    board = build_control({"schedulers": ["primary"]})
    (scheduler,) = board._bound_deployment.init_args[1:]
    for app in (board, scheduler):
        config = app._bound_deployment._deployment_config.logging_config
        assert config["enable_access_log"] is False, app._bound_deployment.name
        assert config["log_level"] == "INFO"
