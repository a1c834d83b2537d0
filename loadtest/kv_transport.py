"""Which transport should carry KV-cache events from engine replicas to the routers?

    python -m loadtest.kv_transport [--seconds 2] [--out loadtest/results/kv_transport.json]

A cache-aware router is only as good as the freshest block set it knows, and Serve's routing
stats arrive by polling: with a report every ``period`` seconds the router's index is on average
period/2 and at worst a whole period behind, and every report carries the replica's whole block
set. Pushing small deltas instead is only worth it if the push is fast, reaches every router
(fan-out) and does not drop events under a burst, so this measures exactly that for the three
candidates: ZeroMQ PUB/SUB, Redis pub/sub and fire-and-forget Ray actor calls. One publisher
(an engine replica) sends msgpack batches to two subscriber processes (routers), first at a
steady 100 batches/s, then as fast as it can; one-way latency is receive time minus the send
timestamp (one machine, one clock). The first batches are paced warm-up (slow joiners, actor
start-up) and not counted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

WARMUP = 50  # batches, sent at WARMUP_RATE and not counted
WARMUP_RATE = 100.0
SUBSCRIBERS = 2
TOPIC = b"kv"
REDIS_URL = "redis://127.0.0.1:6379/15"
POLL_PERIOD_S = 0.5  # the routing experiment's ``stats_period_s``
NUM_KV_BLOCKS = 1100  # the routing experiment's cache size: what one stats report carries


def _ops_pool(n: int = 64, seed: int = 7) -> list[list]:
    """Pre-built ops, so the publisher's top rate is the transport's, not ``random``'s."""
    rng = random.Random(seed)
    return [
        [
            ["s", [rng.getrandbits(64) for _ in range(rng.randint(8, 100))]],
            ["r", [rng.getrandbits(64) for _ in range(rng.randint(1, 4))]],
        ]
        for _ in range(n)
    ]


def _publish(send: Callable[[bytes], None], rate: float | None, seconds: float) -> dict:
    """Warm up, then send for ``seconds`` at ``rate`` batches/s (None: flat out)."""
    ops = _ops_pool()

    def batch(seq: int) -> bytes:
        load = {"backlog": seq % 13, "running": seq % 8, "waiting": seq % 5, "slots": 8}
        body = {"seq": seq, "epoch": 1, "ts": time.time(), "ops": ops[seq % len(ops)]}
        return msgpack.packb({**body, "load": load})

    for seq in range(WARMUP):
        send(batch(seq))
        time.sleep(1 / WARMUP_RATE)
    sent, start = 0, time.perf_counter()
    while (sent < rate * seconds) if rate else (time.perf_counter() - start < seconds):
        if rate and (wait := start + sent / rate - time.perf_counter()) > 0:
            time.sleep(wait)
        send(batch(WARMUP + sent))
        sent += 1
    elapsed = time.perf_counter() - start
    return {"sent": sent, "publish_rate": round(sent / elapsed, 1)}


class Recorder:
    """A subscriber's tally: one-way latency of every counted batch."""

    def __init__(self) -> None:
        self.latencies_ms: list[float] = []
        self.first = self.last = 0.0

    def on(self, payload: bytes) -> None:
        now = time.time()
        batch = msgpack.unpackb(payload)
        if batch["seq"] < WARMUP:
            return
        self.latencies_ms.append((now - batch["ts"]) * 1e3)
        self.first, self.last = self.first or now, now

    def summary(self) -> dict:
        lat = sorted(self.latencies_ms)
        if not lat:
            return {"received": 0}
        span = self.last - self.first
        return {
            "received": len(lat),
            "p50_ms": round(lat[len(lat) // 2], 3),
            "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3),
            "max_ms": round(lat[-1], 3),
            "rate": round(len(lat) / span, 1) if span > 0 else None,
        }


class RaySubscriber(Recorder):
    """The same tally as an async Ray actor: the publisher calls ``on_batch`` without waiting."""

    async def on_batch(self, payload: bytes) -> None:
        self.on(payload)

    async def report(self) -> dict:
        return self.summary()


def _subscribe(kind: str, address: str, barrier: Any, stop: Any, results: Any) -> None:
    """A router process: connect, pass the barrier, record until told to stop and drained."""
    if kind == "zmq":
        import zmq

        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.connect(address)
        sock.setsockopt(zmq.SUBSCRIBE, TOPIC)

        def recv() -> bytes | None:
            return sock.recv_multipart()[1] if sock.poll(200) else None
    else:
        import redis

        pubsub = redis.Redis.from_url(REDIS_URL).pubsub()
        pubsub.subscribe(address)
        assert pubsub.get_message(timeout=10)["type"] == "subscribe"  # the server has it

        def recv() -> bytes | None:
            message = pubsub.get_message(timeout=0.2)
            return message["data"] if message else None

    recorder = Recorder()
    barrier.wait()
    while (payload := recv()) is not None or not stop.is_set():
        if payload is not None:
            recorder.on(payload)
    results.put(recorder.summary())


def _run_processes(kind: str, rate: float | None, seconds: float) -> dict:
    """ZeroMQ or Redis: this process publishes, two spawned processes subscribe."""
    ctx = mp.get_context("spawn")
    barrier, stop, results = ctx.Barrier(SUBSCRIBERS + 1), ctx.Event(), ctx.Queue()
    if kind == "zmq":
        import zmq

        pub = zmq.Context.instance().socket(zmq.PUB)
        address = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"

        def send(payload: bytes) -> None:
            pub.send_multipart([TOPIC, payload])
    else:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        address = f"forge:kv-transport:{uuid.uuid4().hex}"

        def send(payload: bytes) -> None:
            client.publish(address, payload)

    procs = [
        ctx.Process(target=_subscribe, args=(kind, address, barrier, stop, results))
        for _ in range(SUBSCRIBERS)
    ]
    for proc in procs:
        proc.start()
    barrier.wait(timeout=30)
    published = _publish(send, rate, seconds)
    stop.set()
    subs = [results.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=10)
    return {**published, "subscribers": subs}


def _run_ray(rate: float | None, seconds: float) -> dict:
    """Ray: the driver publishes by calling both subscriber actors, fire and forget."""
    import ray

    subs = [ray.remote(num_cpus=0)(RaySubscriber).remote() for _ in range(SUBSCRIBERS)]
    ray.get([sub.report.remote() for sub in subs])  # both actors are up

    calls: list[ray.ObjectRef] = []

    def send(payload: bytes) -> None:
        calls.extend(sub.on_batch.remote(payload) for sub in subs)  # not awaited here

    published = _publish(send, rate, seconds)
    ray.get(calls)  # drain: an async actor need not run one caller's calls in order
    reports = ray.get([sub.report.remote() for sub in subs])
    for sub in subs:
        ray.kill(sub)
    return {**published, "subscribers": reports}


def _poll_analysis() -> dict:
    """(d), not run: what polling Serve's routing stats costs, for comparison."""
    rng = random.Random(0)
    block_set = msgpack.packb([rng.getrandbits(64) for _ in range(NUM_KV_BLOCKS)])
    return {
        "transport": "serve_stats_poll",
        "period_s": POLL_PERIOD_S,
        "mean_staleness_ms": POLL_PERIOD_S / 2 * 1e3,
        "worst_staleness_ms": POLL_PERIOD_S * 1e3,
        "report_bytes_per_replica": len(block_set),
        "note": "each report carries the whole block set, changed or not; events carry deltas",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/kv_transport.json"))
    args = parser.parse_args()

    rows: list[dict] = []

    def record(transport: str, rate: float | None, row: dict) -> None:
        for sub in row["subscribers"]:
            sub["lost"] = row["sent"] - sub["received"]
        rows.append({"transport": transport, "rate": int(rate) if rate else "max", **row})
        print(json.dumps(rows[-1]), flush=True)

    for kind in ("zmq", "redis"):
        for rate in (100.0, None):
            record(kind, rate, _run_processes(kind, rate, args.seconds))

    import ray

    ray.init(
        num_cpus=2,
        object_store_memory=100_000_000,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    try:
        for rate in (100.0, None):
            record("ray", rate, _run_ray(rate, args.seconds))
    finally:
        ray.shutdown()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"seconds": args.seconds, "results": rows, "analysis": _poll_analysis()}
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
