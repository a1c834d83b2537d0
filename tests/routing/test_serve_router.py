"""``ForgeRequestRouter`` built as Serve builds it, without Serve: breakers, retries, probes,
prompts and the replicas' KV events (a real publisher), as the router sees them per request.

The router is constructed like Ray's own router unit tests do (``FakeRunningReplica``, a
``DeploymentID``, a handle source) and then given its policy through ``initialize_state``, the
call Serve makes with the pool's ``request_router_kwargs``. Requests are ``PendingRequest``s
whose ``args`` are what the gateway passes to ``stream``/``complete``: ``[body, kind, id]``.
No Ray cluster: Ray's metric objects work without one.
"""

from __future__ import annotations

import uuid
import zlib
from dataclasses import replace
from typing import Any

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve._private.test_utils import FakeRunningReplica
from ray.serve.request_router import PendingRequest

from serve_app import tokenizer
from serve_app.bridge import pool_bridge, replica_backend, reset_bridges
from serve_app.config.models import KvEventsConfig
from serve_app.kvcache.block_hashes import prefix_block_hashes
from serve_app.kvcache.curve import CurveKeys
from serve_app.kvcache.events import EngineLoad, KvEventPublisher
from serve_app.resilience.board import BreakerBoard
from serve_app.resilience.breaker import BreakerSettings, Outcome
from serve_app.resilience.client import BreakerClient
from serve_app.routing.base import RouteRequest
from serve_app.routing.prompt_hashing import SimulatedPromptHasher
from serve_app.routing.serve_router import ForgeRequestRouter
from tests.doubles import MODEL, Clock
from tests.polling import eventually_async

APP = "forge-test"
DEPLOYMENT = DeploymentID(name="pool-primary", app_name=APP)
POOL = "primary"  # the pool as the gateway names it
BLOCK_SIZE = 4
COOLDOWN_S = 5.0


class Replica(FakeRunningReplica):
    """Ray's fake replica, with the routing stats a real one publishes settable by the test."""

    def __init__(self, unique_id: str, routing_stats: dict[str, Any] | None = None) -> None:
        super().__init__(unique_id)
        self.routing_stats = routing_stats or {}
        # The router probes a new replica's queue length once: answer it (nothing in flight).
        self.set_queue_len_response(0)

    @property
    def routing_stats(self) -> dict[str, Any]:
        return self._routing_stats

    @routing_stats.setter
    def routing_stats(self, stats: dict[str, Any]) -> None:
        self._routing_stats = stats


@pytest.fixture(autouse=True)
def fresh_bridges():
    reset_bridges()
    yield
    reset_bridges()


@pytest.fixture
def clock() -> Clock:
    return Clock(1000.0)


@pytest.fixture
async def board(clock: Clock) -> BreakerBoard:
    return BreakerBoard(BreakerSettings(failure_threshold=1, cooldown_s=COOLDOWN_S), clock)


@pytest.fixture
async def breakers(board: BreakerBoard, clock: Clock):
    """The gateway's breaker client, installed on the pool's bridge as the ingress does."""
    client = BreakerClient(board, sync_interval_s=60, clock=clock)
    pool_bridge(APP, POOL).breakers = client
    yield client
    await client.aclose()


def make_router(
    policy: str = "round_robin", deployment: DeploymentID = DEPLOYMENT, **options: Any
) -> ForgeRequestRouter:
    router = ForgeRequestRouter(
        deployment_id=deployment, handle_source=DeploymentHandleSource.REPLICA
    )
    router.initialize_state(policy=policy, block_size=BLOCK_SIZE, **options)
    return router


def chat_body(prompt: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True}


def pending(request_id: str, prompt: str = "hello there") -> PendingRequest:
    """A call ``stream.remote(body, "chat", request_id)`` as Serve's router holds it."""
    return PendingRequest(
        args=[chat_body(prompt), "chat", request_id],
        kwargs={},
        metadata=RequestMetadata(
            request_id=request_id,
            internal_request_id=uuid.uuid4().hex,
            call_method="stream",
            is_streaming=True,
        ),
    )


async def ranked(
    router: ForgeRequestRouter, replicas: list[Replica], request: PendingRequest | None
) -> list[str]:
    """The replica ids the router hands Serve, one per rank, in order."""
    ranks = await router.choose_replicas(replicas, request)
    assert all(len(rank) == 1 for rank in ranks), ranks
    return [rank[0].replica_id.unique_id for rank in ranks]


async def open_breaker(board: BreakerBoard, client: BreakerClient, replica_id: str) -> None:
    """A failure some gateway reported (threshold 1) opens the replica's breaker on the board;
    this gateway's client hears of it on its next sync."""
    await board.sync([(replica_backend(POOL, replica_id), Outcome.FAILURE.value, False, 1)])
    await client.flush()


def prompt_blocks(prompt: str) -> list[int]:
    """The block hashes a replica that served ``prompt`` would report as cached."""
    text = tokenizer.render_chat(chat_body(prompt)["messages"])
    return list(prefix_block_hashes(tokenizer.encode(text), BLOCK_SIZE))


# -- the replica set, on the bridge ----------------------------------------------------------


async def test_update_replicas_publishes_the_replica_ids_on_the_pools_bridge():
    router = make_router()
    bridge = pool_bridge(APP, POOL)
    assert bridge.replica_ids is None  # the gateway cannot tell cold from unknown yet

    a, b, c = Replica("a"), Replica("b"), Replica("c")
    router.update_replicas([a, b, c])
    assert bridge.replica_ids == {"a", "b", "c"}

    router.update_replicas([b, c])
    assert bridge.replica_ids == {"b", "c"}

    router.on_replica_actor_died(b.replica_id)
    assert bridge.replica_ids == {"c"}

    router.update_replicas([])
    assert bridge.replica_ids == frozenset()  # cold: zero, not unknown

    # Other pools and other applications have bridges of their own.
    assert pool_bridge(APP, "secondary").replica_ids is None
    assert pool_bridge("other-app", POOL).replica_ids is None


async def test_the_engine_the_replicas_run_reaches_the_gateway_when_they_agree():
    """A pool in its own application may roll under the gateway: the cache keys by what the
    replicas report, nothing while two engines serve, and the last agreed one at zero."""
    from serve_app.bridge import BridgedPool

    router = make_router()
    pool = BridgedPool(POOL, pool_bridge(APP, POOL))
    a = Replica("a")
    router.update_replicas([a])
    assert pool.engine_identity() is None  # not said yet
    a.routing_stats = {"engine_identity": "engine-1"}
    assert pool.engine_identity() == "engine-1"
    b = Replica("b", {"engine_identity": "engine-2"})  # the roll: a new replica, a new engine
    router.update_replicas([a, b])
    assert pool.engine_identity() is None
    router.update_replicas([b, Replica("c")])  # the old one gone; c has not said yet
    assert pool.engine_identity() == "engine-2"
    router.update_replicas([])  # scaled to zero: the pool still runs what it last ran
    assert pool.engine_identity() == "engine-2"
    # Rolled while the gateway looked away: only new replicas, none has said. Keying by the
    # last agreed engine would replay its answers for another's (CI saw it: a cache hit
    # right after a pool's roll).
    d = Replica("d")
    router.update_replicas([d])
    assert pool.engine_identity() is None
    d.routing_stats = {"engine_identity": "engine-3"}
    assert pool.engine_identity() == "engine-3"


# -- breakers and retries --------------------------------------------------------------------


async def test_a_replica_whose_breaker_is_open_is_never_chosen(board, breakers):
    router = make_router("round_robin")
    replicas = [Replica("a"), Replica("b"), Replica("c")]
    router.update_replicas(replicas)
    await open_breaker(board, breakers, "b")

    for i in range(6):  # round robin would reach every replica as first choice
        ids = await ranked(router, replicas, pending(f"req-{i}"))
        assert "b" not in ids
        assert set(ids) == {"a", "c"}


async def test_a_retry_avoids_the_replica_its_first_attempt_failed_on():
    router = make_router("least_in_flight")
    replicas = [Replica("a"), Replica("b"), Replica("c")]
    router.update_replicas(replicas)
    bridge = pool_bridge(APP, POOL)
    first = (await ranked(router, replicas, pending("req-1")))[0]

    bridge.avoid["req-1"] = first
    retry = await ranked(router, replicas, pending("req-1"))
    assert first not in retry and len(retry) == 2

    # Only that request's retry: another request may still go there.
    assert first in await ranked(router, replicas, pending("req-2"))


async def test_never_excludes_every_replica(board, breakers):
    router = make_router("least_in_flight")
    replicas = [Replica("a"), Replica("b")]
    router.update_replicas(replicas)
    await open_breaker(board, breakers, "a")
    pool_bridge(APP, POOL).avoid["req-1"] = "b"

    # a is open and b is the one to avoid: rather than nowhere, the request may go anywhere
    # (the pool's own breaker is what keeps traffic off a pool that is all down).
    assert sorted(await ranked(router, replicas, pending("req-1"))) == ["a", "b"]

    await open_breaker(board, breakers, "b")
    assert sorted(await ranked(router, replicas, pending("req-2"))) == ["a", "b"]


async def test_a_half_open_replica_gets_exactly_one_probe(breakers, board, clock):
    router = make_router("least_in_flight")
    a, b, c = Replica("a"), Replica("b"), Replica("c")
    replicas = [a, b, c]
    router.update_replicas(replicas)
    bridge = pool_bridge(APP, POOL)
    await open_breaker(board, breakers, "a")
    assert "a" not in await ranked(router, replicas, pending("req-0"))  # cooling down

    clock.advance(COOLDOWN_S)
    probe = pending("req-probe")
    assert await ranked(router, replicas, probe) == ["a"]  # the probe, and only a
    # Serve asks again for the same request when it backs off: it stays the probe, and the
    # board is not asked for a second grant.
    assert await ranked(router, replicas, probe) == ["a"]
    assert (await board.describe())[replica_backend(POOL, "a")]["probes"] == 1

    # Everyone else routes around a while its probe is out.
    for i in range(3):
        assert "a" not in await ranked(router, replicas, pending(f"req-{i + 1}"))

    # Another gateway replica (its own router and client, the same board) gets no probe either.
    other_client = BreakerClient(board, sync_interval_s=60, clock=clock)
    pool_bridge("forge-test-2", POOL).breakers = other_client
    other = make_router(
        "least_in_flight", DeploymentID(name="pool-primary", app_name="forge-test-2")
    )
    other.update_replicas(replicas)
    await other_client.flush()
    assert "a" not in await ranked(other, replicas, pending("req-elsewhere"))
    await other_client.aclose()
    assert (await board.describe())[replica_backend(POOL, "a")]["probes"] == 1

    # Serve reports where each request went: the probe is noted as one, so its outcome is
    # reported to the breaker as the probe's verdict.
    router.on_request_routed(probe, a.replica_id, None)
    other_request = pending("req-other")
    router.on_request_routed(other_request, b.replica_id, None)
    assert bridge.take_routed("req-probe") == ("a", True)
    assert bridge.take_routed("req-other") == ("b", False)


async def test_a_call_without_a_request_id_is_routed_but_not_noted(board, breakers):
    """The pool's wake-up call (``ready()``) has no Forge request id."""
    router = make_router("least_in_flight")
    a, b = Replica("a"), Replica("b")
    router.update_replicas([a, b])
    await open_breaker(board, breakers, "a")
    ready = PendingRequest(
        args=[],
        kwargs={},
        metadata=RequestMetadata(request_id="x", internal_request_id="i", call_method="ready"),
    )
    assert await ranked(router, [a, b], ready) == ["b"]
    router.on_request_routed(ready, b.replica_id, None)
    assert pool_bridge(APP, POOL).routed == {}


async def test_the_replicas_offered_are_noted_until_serve_says_which_took_the_request():
    """Serve sends a request, then waits for the replica's word that it took it: a request
    cancelled in between may have run, and only the replicas it was offered can say
    (``PoolBridge.offered``, asked by ``dispatch._charge_abandoned``)."""
    router = make_router("least_in_flight")
    replicas = [Replica("a"), Replica("b"), Replica("c")]
    router.update_replicas(replicas)
    bridge = pool_bridge(APP, POOL)
    request = pending("req-offered")
    order = await ranked(router, replicas, request)
    assert bridge.offered["req-offered"] == tuple(order)
    assert bridge.routed == {}

    router.on_request_routed(request, replicas[1].replica_id, None)
    assert "req-offered" not in bridge.offered
    assert bridge.take_routed("req-offered") == ("b", False)


# -- prompts ---------------------------------------------------------------------------------


async def test_prefix_affinity_sends_the_same_prompt_to_the_same_replica():
    replicas = [Replica(f"replica-{i}") for i in range(5)]
    router = make_router("prefix_affinity")
    router.update_replicas(replicas)
    # Another gateway replica's router: the choice must not depend on who makes it.
    other = make_router("prefix_affinity")
    other.update_replicas(replicas)

    firsts = set()
    for n in range(20):
        prompt = f"{n} tell me about rivers and the sea"
        first = (await ranked(router, replicas, pending(f"req-{n}-a", prompt)))[0]
        assert (await ranked(router, replicas, pending(f"req-{n}-b", prompt)))[0] == first
        assert (await ranked(other, replicas, pending(f"req-{n}-c", prompt)))[0] == first
        firsts.add(first)
    # The choice follows the prompt: different prompts spread over the pool.
    assert len(firsts) >= 3


async def wait_for(condition, timeout_s: float = 5.0) -> None:
    """The index applies events on its own thread: give it the milliseconds it needs."""
    await eventually_async(
        condition, timeout_s=timeout_s, what="the router's index to catch up", interval_s=0.005
    )


@pytest.fixture
async def publisher(monkeypatch):
    """Replica "b"'s KV event publisher, as a real replica runs it, holding ``blocks``: behind
    CURVE with the cluster's key, which the router reads from the variable the config names."""
    keys = CurveKeys.generate()
    monkeypatch.setenv(KvEventsConfig().curve_secret_env, keys.secret.decode())
    blocks: set[int] = set()
    pub = KvEventPublisher("b", lambda: blocks, keys=keys)
    pub.start()
    pub.blocks = blocks
    yield pub
    await pub.close()


def kv_router(replicas: list[Replica], publisher: KvEventPublisher) -> ForgeRequestRouter:
    router = make_router("kv_aware")
    router.update_replicas(replicas)
    replicas[1].routing_stats = {"kv_events": publisher.describe()}
    return router


async def test_kv_aware_follows_the_blocks_a_replica_publishes_and_evicts(publisher):
    replicas = [Replica("a"), Replica("b")]
    router = kv_router(replicas, publisher)
    prompt = "3 tell me about rivers and the sea"
    assert await ranked(router, replicas, pending("req-1", prompt)) == ["a", "b"]  # tie: by id
    await wait_for(lambda: router.index.watching("b"))

    blocks = prompt_blocks(prompt)
    publisher.blocks.update(blocks)
    publisher.stored(blocks)
    publisher.flush(EngineLoad(slots=8))
    await wait_for(lambda: blocks[-1] in router.index.blocks("b"))
    assert await ranked(router, replicas, pending("req-2", prompt)) == ["b", "a"]

    publisher.blocks.clear()
    publisher.removed(blocks)  # evicted: the index must forget them, or it routes to a miss
    publisher.flush(EngineLoad(slots=8))
    await wait_for(lambda: not router.index.blocks("b"))
    assert await ranked(router, replicas, pending("req-3", prompt)) == ["a", "b"]
    router.index.close()


async def test_kv_aware_remembers_where_it_sent_a_new_prompt_before_any_event(publisher):
    replicas = [Replica("a"), Replica("b")]
    router = kv_router(replicas, publisher)
    prompt = "7 a prompt no replica has seen"
    first = pending("req-1", prompt)
    assert (await ranked(router, replicas, first))[0] == "a"
    router.on_request_routed(first, replicas[1].replica_id, None)  # Serve sent it to "b"
    # No event yet from "b": the router's own memory sends the same prompt after it.
    assert (await ranked(router, replicas, pending("req-2", prompt)))[0] == "b"
    # ... and counts its prefill as b's backlog until b's engine says it took it in.
    assert router.index.assigned_tokens("b") > 0
    await wait_for(lambda: router.index.watching("b"))
    publisher.accepted("req-1-1")  # the engine's id for it: "<forge id>-<n>"
    publisher.flush(EngineLoad(backlog=5, slots=8))
    await wait_for(lambda: router.index.assigned_tokens("b") == 0)
    assert router.index.load("b").backlog == 5
    router.index.close()


class _Counted:
    """Stands in for a counter: what it was incremented by, and for which replica."""

    def __init__(self) -> None:
        self.values: list[tuple[float, dict]] = []

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self.values.append((value, tags or {}))


async def test_kv_aware_counts_the_cached_tokens_its_index_expected_on_the_chosen_replica(
    publisher,
):
    """What vLLM's prefix-cache hits on that replica are compared with (loadtest.vllm_routing)."""
    replicas = [Replica("a"), Replica("b")]
    router = kv_router(replicas, publisher)
    router._index_hit_tokens = expected = _Counted()
    prompt = "5 the same prompt, sent twice to the same replica"
    first = pending("req-1", prompt)
    await ranked(router, replicas, first)
    router.on_request_routed(first, replicas[1].replica_id, None)  # Serve sent it to "b"
    assert expected.values == []  # nothing was cached anywhere

    second = pending("req-2", prompt)
    assert (await ranked(router, replicas, second))[0] == "b"
    router.on_request_routed(second, replicas[1].replica_id, None)

    assert expected.values == [(len(prompt_blocks(prompt)) * BLOCK_SIZE, {"target": "b"})]
    router.index.close()


# -- follow-up calls ---------------------------------------------------------------------------


def usage_question(request_id: str) -> PendingRequest:
    """``abandoned_usage.remote(request_id=..., replica_id=..., wait_s=...)`` as Serve holds it."""
    return PendingRequest(
        args=[],
        kwargs={"request_id": request_id, "replica_id": "b", "wait_s": 1.0},
        metadata=RequestMetadata(
            request_id=request_id, internal_request_id="q", call_method="abandoned_usage"
        ),
    )


async def test_a_question_about_a_request_goes_to_its_replica_even_past_an_open_breaker(
    board, breakers
):
    router = make_router("round_robin")
    replicas = [Replica("a"), Replica("b"), Replica("c")]
    router.update_replicas(replicas)
    await open_breaker(board, breakers, "b")  # it failed mid-stream; it still knows the usage
    bridge = pool_bridge(APP, POOL)
    bridge.pinned["req-1"] = "b"
    for _ in range(3):
        assert await ranked(router, replicas, usage_question("req-1")) == ["b"]
    router.on_request_routed(usage_question("req-1"), replicas[1].replica_id, None)
    assert bridge.routed == {}  # not an attempt of the request: nothing for dispatch to collect


async def test_a_question_for_a_replica_that_is_gone_still_goes_somewhere():
    """A call Serve cannot place would wait forever, and cancelling an unplaced call blocks
    the event loop: any replica answers (None) instead."""
    router = make_router("round_robin")
    replicas = [Replica("a"), Replica("c")]
    router.update_replicas(replicas)
    pool_bridge(APP, POOL).pinned["req-1"] = "b"
    assert len(await ranked(router, replicas, usage_question("req-1"))) == 1


# -- LoRA adapters -----------------------------------------------------------------------------


def adapter_request(request_id: str, adapter: str | None) -> PendingRequest:
    request = pending(request_id)
    if adapter is not None:
        request.args[0]["forge_adapter"] = adapter
    return request


async def test_an_adapters_requests_follow_the_replica_that_has_it_loaded():
    replicas = [Replica(f"replica-{i}", {"max_loras": 2}) for i in range(3)]
    replicas[2].routing_stats = {"max_loras": 2, "lora_adapters": ["support"]}
    router = make_router("round_robin")
    router.update_replicas(replicas)
    firsts = [
        (await ranked(router, replicas, adapter_request(f"r{n}", "support")))[0] for n in range(6)
    ]
    assert firsts == ["replica-2"] * 6  # round robin alone would have rotated
    base = [(await ranked(router, replicas, adapter_request(f"b{n}", None)))[0] for n in range(3)]
    assert len(set(base)) == 3  # the base model's requests are the policy's alone


async def test_a_new_adapter_stays_where_this_router_sent_it_before_any_report():
    replicas = [Replica(f"replica-{i}", {"max_loras": 2}) for i in range(3)]
    router = make_router("round_robin")
    router.update_replicas(replicas)
    first = await ranked(router, replicas, request := adapter_request("r0", "legal"))
    router.on_request_routed(request, replicas[int(first[0][-1])].replica_id, None)
    again = await ranked(router, replicas, adapter_request("r1", "legal"))
    assert again[0] == first[0]  # no stats said so yet: the router remembered
    off = make_router("round_robin", adapter_affinity=False)
    off.update_replicas(replicas)
    rotated = [
        (await ranked(off, replicas, adapter_request(f"o{n}", "legal")))[0] for n in range(3)
    ]
    assert len(set(rotated)) == 3


async def test_kv_aware_does_not_take_an_adapters_blocks_for_the_base_models(publisher):
    replicas = [Replica("a"), Replica("b")]
    router = kv_router(replicas, publisher)
    prompt = "8 a prompt an adapter served first"
    first = adapter_request("req-1", "support")
    first.args[0]["messages"][0]["content"] = prompt
    await ranked(router, replicas, first)
    router.on_request_routed(first, replicas[1].replica_id, None)  # Serve sent it to "b"
    assert router.index.assigned_tokens("b") > 0  # its prefill is b's backlog...
    # ...but b holds the adapter's blocks, not the base model's: nothing draws this there.
    assert (await ranked(router, replicas, pending("req-2", prompt)))[0] == "a"
    router.index.close()


class AdapterKeyedHasher(SimulatedPromptHasher):
    """Names an adapter's blocks apart from the base model's, as vLLM does (and its hasher)."""

    keys_adapters = True

    def route(self, body: dict, kind: str) -> RouteRequest:
        route = super().route(body, kind)
        if route.adapter is None:
            return route
        salt = zlib.crc32(route.adapter.encode())
        return replace(route, block_hashes=tuple(h ^ salt for h in route.block_hashes))


class FollowingHasher(SimulatedPromptHasher):
    def __init__(self) -> None:
        super().__init__(BLOCK_SIZE, 128)
        self.followed: list[dict] = []

    def follow(self, block_hashing: dict) -> None:
        self.followed.append(block_hashing)


async def test_the_prompt_hasher_follows_the_block_hashing_a_replica_reports():
    hashing = {"algo": "sha256", "seed": "0", "block_size": 32}
    replicas = [Replica("a"), Replica("b", {"block_hashing": hashing})]
    router = make_router("prefix_affinity")
    router.update_replicas(replicas)
    router.hasher = FollowingHasher()

    await ranked(router, replicas, pending("req-1"))

    assert router.hasher.followed == [hashing]


async def test_kv_aware_follows_an_adapters_blocks_where_its_hasher_keys_them(publisher):
    replicas = [Replica("a"), Replica("b")]
    router = kv_router(replicas, publisher)
    router.hasher = AdapterKeyedHasher(BLOCK_SIZE, 128)  # a vLLM pool's, in kind
    prompt = "8 a prompt an adapter served first"
    first = adapter_request("req-1", "support")
    first.args[0]["messages"][0]["content"] = prompt
    await ranked(router, replicas, first)
    router.on_request_routed(first, replicas[1].replica_id, None)  # Serve sent it to "b"
    again = adapter_request("req-2", "support")
    again.args[0]["messages"][0]["content"] = prompt

    assert (await ranked(router, replicas, again))[0] == "b", "the adapter's blocks are on b"
    assert (await ranked(router, replicas, pending("req-3", prompt)))[0] == "a", "not the base's"
    router.index.close()
