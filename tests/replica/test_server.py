"""The replica deployment's logic without Serve: coalescing, metadata, faults, abort."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from serve_app.replica.faults import InjectedFault
from serve_app.replica.server import Replica
from tests.polling import eventually_async

BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 12,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def replica(**engine) -> Replica:
    return Replica({"name": "p", "model": "m", "engine": engine})


async def collect(r: Replica, body: dict = BODY) -> list[list]:
    return [batch async for batch in r.stream(body, "chat", "req-1")]


async def test_first_batch_names_the_replica_and_the_last_carries_usage():
    batches = await collect(replica())
    assert batches[0][0] == {"replica": "local"}
    usage = batches[-1][-1]["usage"]
    assert usage["completion_tokens"] == 12
    frames = [x for b in batches for x in b if type(x) is bytes]
    assert frames[-1].startswith(b"data: ") and b'"usage":{' in frames[-1]


async def test_frames_ready_together_travel_as_one_item():
    """A consumer slower than the engine gets several frames per handle item, never fewer."""
    r = replica()
    items = []
    async for batch in r.stream(BODY, "chat", "req-1"):
        items.append(batch)
        # A slow consumer: it takes the next item only once the engine has generated them all.
        await eventually_async(
            lambda: r.engine.llm.generation_tokens == 12,
            timeout_s=5,
            what="the engine to run ahead and generate all 12 tokens",
            explain=r.stats,
        )
    frames = sum(1 for b in items for x in b if type(x) is bytes)
    assert frames == 1 + 12 + 1 + 1  # role, tokens, finish, usage
    assert len(items) < frames / 2


async def test_open_streams_counts_a_stream_until_its_generator_closes():
    r = replica()
    stream = r.stream(BODY, "chat", "req-1")
    assert r.stats()["open_streams"] == 0  # not started
    await anext(stream)
    assert r.stats()["open_streams"] == 1
    async for _ in stream:
        pass
    assert r.stats()["open_streams"] == 0
    abandoned = r.stream(BODY, "chat", "req-2")
    await anext(abandoned)
    await abandoned.aclose()  # the caller left mid-stream
    assert r.stats()["open_streams"] == 0


async def test_closing_the_stream_aborts_the_generation():
    r = replica(decode_base_s=0.01)
    body = {**BODY, "max_tokens": 500, "ignore_eos": True}
    stream = r.stream(body, "chat", "req-1")
    await anext(stream)
    await eventually_async(
        lambda: r.engine.llm.generation_tokens >= 2,
        timeout_s=5,
        what="the generation to get under way",
        explain=r.stats,
    )
    assert r.stats()["num_requests_running"] == 1
    await stream.aclose()
    await eventually_async(
        lambda: r.stats()["num_requests_running"] == 0,
        timeout_s=5,
        what="the closed stream's generation to be aborted",
        explain=r.stats,
    )


async def test_error_fault_fails_before_any_frame():
    r = replica()
    r.set_fault({"mode": "error"})
    with pytest.raises(InjectedFault):
        await collect(r)
    r.set_fault(None)
    assert await collect(r)


async def test_hang_fault_waits_until_cancelled():
    r, control = replica(), replica()
    r.set_fault({"mode": "hang"})
    task = asyncio.ensure_future(collect(r))
    # The same request without the fault runs to its end meanwhile; the hung one got nowhere.
    assert await collect(control)
    assert r.stats()["open_streams"] == 1
    assert r.engine.llm.generation_tokens == 0
    assert not task.done()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_die_mid_stream_without_exiting_delivers_some_frames_then_fails():
    r = replica()
    r.set_fault({"mode": "die_mid_stream", "after_frames": 3, "exit_process": False})
    got = []
    with pytest.raises(InjectedFault):
        async for batch in r.stream(BODY, "chat", "req-1"):
            got += [x for x in batch if type(x) is bytes]
    assert 0 < len(got) <= 3


async def test_slow_fault_slows_the_engine():
    r = replica(decode_base_s=0.002)
    r.set_fault({"mode": "slow", "factor": 5})
    assert r.engine.llm.slow_factor == 5
    r.set_fault(None)
    assert r.engine.llm.slow_factor == 1.0


async def test_an_idle_kv_aware_replica_beats_from_the_moment_it_says_where(monkeypatch):
    """A router subscribes where the replica's routing stats point; the replica has served
    nothing yet (its engine not started), and still its events arrive, heartbeats at least, over
    CURVE with the cluster's key: silence would read as a dead replica."""
    import zmq
    import zmq.asyncio

    from serve_app.kvcache.curve import CurveKeys, connect_curve

    keys = CurveKeys.generate()
    monkeypatch.setenv("FORGE_KV_CURVE_SECRET", keys.secret.decode())
    r = Replica(
        {
            "name": "p",
            "model": "m",
            "engine": {"kind": "simulated"},
            "routing": {"policy": "kv_aware"},
        }
    )
    where = (await r.record_routing_stats())["kv_events"]
    ctx = zmq.asyncio.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        connect_curve(sub, keys)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(where["endpoint"])
        assert await sub.poll(10_000), "the idle replica's heartbeat"
        assert not r._started, "and its engine still waits for a first request"
    finally:
        ctx.destroy(linger=0)
        await r.kv_events.close()


async def test_routing_stats_say_how_the_engine_names_blocks_when_it_says():
    r = replica()
    assert "block_hashing" not in await r.record_routing_stats()  # the simulator: config says

    hashing = {"algo": "sha256", "seed": None, "block_size": 32}
    r.engine.block_hashing = lambda: hashing  # as vLLM's engine reports its own

    assert (await r.record_routing_stats())["block_hashing"] == hashing
