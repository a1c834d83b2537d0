"""KV-cache events: each replica pushes what its prefix cache stores and evicts, as it happens.

A KV-aware router is only as good as its picture of where prompts are cached. Polled reports
(Serve's routing stats) are up to a period old and carry the whole block set each time; here
the replica publishes *changes* the moment its engine makes them, plus the prefill work it has
queued (``EngineLoad``), and the routers of every gateway replica apply them to their index
(``serve_app/routing/kv_index.py``) within milliseconds.

Transport: ZeroMQ PUB/SUB, as vLLM's own KV event publisher uses; chosen by measurement
(``loadtest/kv_transport.py``, ``docs/routing.md``). One PUB socket per replica, bound on the
node's address at a free port; routers learn it from the replica's routing stats.

Reliability: every message carries the publisher's ``epoch`` (random per process) and a ``seq``
(+1 per message). A router that sees a new epoch or a gap asks the replica's snapshot socket
for the full block set and the seq it is current to, then replays what it buffered after
that seq. Applying a message twice is harmless (its operations are set adds and removes in
order), which is what makes snapshot-then-replay exact. A heartbeat each ``heartbeat_s``
bounds how long a lost last message can go unnoticed.

Wire format (msgpack): frames ``[replica_id, payload]``; payload ``{"v", "epoch", "seq", "ts",
"ops": [["s", [hash, ...]] | ["r", [hash, ...]] | ["c"]], "accepted": [request_id, ...],
"load": {"backlog", "running", "waiting", "slots"}}``; a snapshot is ``{"v", "epoch", "seq",
"blocks": [hash, ...], "load"}``. ``v`` is ``WIRE_VERSION`` (a message without it is version 1,
the format before the field). Hashes are Forge's block-hash chain
(``serve_app/kvcache/block_hashes.py``); nothing of a prompt's text leaves the replica.

Trust (``docs/security.md``): both sockets are ZeroMQ CURVE servers admitting only holders of
the cluster's key (``serve_app/kvcache/curve.py``); plaintext is allowed on loopback only. Every
receiving socket has a size cap (``ZMQ_MAXMSGSIZE``: libzmq drops the connection of a peer that
sends more, before the message is read): ``MAX_REQUEST_BYTES`` on the replica, whose peers only
ever send subscriptions and snapshot requests, and ``max_message_bytes`` on the routers. A
snapshot, the largest message there is, costs the replica a copy of its block set and its
encoding, so each peer address may ask for a few at once and then a few a second
(``PeerRateLimit``), the encoding yields to the event loop between chunks, and an unchanged
snapshot is encoded once. Routers check every message before applying it (``parse_event``,
``parse_snapshot``) and count the ones they skip: ``forge_kv_events_rejected_total{reason}``,
which the replica's side counts too (``rate_limited``, ``malformed``, ``unauthenticated``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import asdict, dataclass, fields

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from serve_app.kvcache.curve import CurveKeys, Gatekeeper, serve_curve
from serve_app.metrics import counter

logger = logging.getLogger("ray.serve")

STORED, REMOVED, CLEARED = "s", "r", "c"
SNAPSHOT_REQUEST = b"snapshot"
WIRE_VERSION = 1

# The routers' cap (``routing.kv_events.max_message_bytes``). The largest message is a snapshot
# of a replica's whole block set, about 9 bytes a block (a 64-bit hash in msgpack): 16 MiB holds
# 1.8M blocks, above the router's own ``max_blocks`` guard of 1M (9 MB) and far above a big
# replica (a 0.5B model on an 80 GB GPU caches ~6M tokens: ~360k blocks of 16).
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
# What a replica's sockets take in: subscriptions and snapshot requests, a few bytes each, and
# the CURVE handshake's commands (a few hundred bytes), which libzmq holds to the same cap.
MAX_REQUEST_BYTES = 4096
_BLOCK_BYTES = 9  # the most a block hash takes in msgpack (a uint64)
_SNAPSHOT_HEADROOM = 1024  # the snapshot's other fields
_CHUNK = 16_384  # blocks encoded between two yields to the event loop (about a millisecond)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a replica has queued, pushed with its events: the router's load bound reads it.

    ``backlog`` is prefill work in tokens: the uncached prompt tokens of its waiting requests
    plus what is left of the prefills under way. ``slots`` is its ``max_num_seqs``.
    """

    backlog: int = 0
    running: int = 0
    waiting: int = 0
    slots: int = 1


_LOAD_FIELDS = tuple(f.name for f in fields(EngineLoad))


def encode(payload: dict) -> bytes:
    return msgpack.packb(payload, use_bin_type=True)


def decode(raw: bytes) -> dict:
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


def rejected_counter(pool: str):
    """``forge_kv_events_rejected_total{pool, reason}``, on both sides: a router's reasons are
    ``malformed`` and ``version``, a replica's ``malformed``, ``rate_limited`` and
    ``unauthenticated`` (Ray's ``deployment`` label tells the sides apart)."""
    series = counter(
        "forge_kv_events_rejected_total",
        "KV-event messages, snapshots and snapshot requests refused, by reason.",
        *("pool", "reason"),
    )
    series.set_default_tags({"pool": pool})
    return series


# The router's side of the wire: what it applies, checked first.


class BadMessage(ValueError):
    """A message a router will not apply; ``reason`` labels the counter it is counted in."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One published message, checked: ``ops`` are ``(kind, hashes)``, CLEARED's empty."""

    epoch: int
    seq: int
    ts: float
    ops: list[tuple[str, list[int]]]
    accepted: list[str]
    load: EngineLoad


@dataclass(frozen=True, slots=True)
class Snapshot:
    epoch: int
    seq: int
    blocks: set[int]
    load: EngineLoad


def parse_event(raw: bytes) -> EventBatch:
    """An event message, or ``BadMessage``: anything a peer sends ends here, not in a crash."""
    msg = _message(raw)
    ops: list[tuple[str, list[int]]] = []
    for op in _field(msg, "ops", list):
        if not isinstance(op, list) or not op:
            raise BadMessage("malformed", f"an op is {op!r:.40}")
        if op[0] == CLEARED and len(op) == 1:
            ops.append((CLEARED, []))
        elif op[0] in (STORED, REMOVED) and len(op) == 2 and _all_hashes(op[1]):
            ops.append((op[0], op[1]))
        else:
            raise BadMessage("malformed", f"an op is not stored, removed or cleared: {op!r:.40}")
    accepted = msg.get("accepted") or []
    if not isinstance(accepted, list) or not all(isinstance(r, str) for r in accepted):
        raise BadMessage("malformed", "accepted is not a list of request ids")
    ts = msg.get("ts")
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise BadMessage("malformed", "ts is not a time")
    return EventBatch(
        _int(msg, "epoch"), _int(msg, "seq"), float(ts), ops, accepted, _load(msg.get("load"))
    )


def parse_snapshot(raw: bytes, max_blocks: int) -> Snapshot:
    """A snapshot reply, or ``BadMessage``; its first ``max_blocks`` blocks as a set."""
    msg = _message(raw)
    blocks = _field(msg, "blocks", list)
    try:  # no per-block type check (100 ms for 1M blocks): a stray hashable matches nothing
        held = set(blocks[:max_blocks])
    except TypeError:
        raise BadMessage("malformed", "blocks holds something that is not a hash") from None
    return Snapshot(_int(msg, "epoch"), _int(msg, "seq"), held, _load(msg.get("load")))


def _message(raw: bytes) -> dict:
    try:
        msg = decode(raw)
    except Exception as exc:  # msgpack raises several kinds; all mean the same here
        raise BadMessage("malformed", f"not msgpack ({type(exc).__name__})") from None
    if not isinstance(msg, dict):
        raise BadMessage("malformed", f"not a map but a {type(msg).__name__}")
    version = msg.get("v", 1)
    if version != WIRE_VERSION or type(version) is not int:
        raise BadMessage("version", f"wire version {version!r:.20}, this router reads 1")
    return msg


def _field(msg: dict, name: str, kind: type):
    value = msg.get(name)
    if not isinstance(value, kind):
        raise BadMessage("malformed", f"{name} is not a {kind.__name__}")
    return value


def _int(msg: dict, name: str) -> int:
    value = msg.get(name)
    if type(value) is not int or value < 0:
        raise BadMessage("malformed", f"{name} is not a non-negative integer")
    return value


def _all_hashes(hashes: object) -> bool:
    return isinstance(hashes, list) and all(type(h) is int for h in hashes)


def _load(value: object) -> EngineLoad:
    """Fields this router knows, each a count; a newer replica's extra fields are ignored."""
    if not isinstance(value, dict):
        raise BadMessage("malformed", "load is not a map")
    known = {name: value[name] for name in _LOAD_FIELDS if name in value}
    if not all(type(v) is int and v >= 0 for v in known.values()):
        raise BadMessage("malformed", "a load field is not a count")
    if known.get("slots", 1) < 1:
        raise BadMessage("malformed", "load.slots is below 1")
    return EngineLoad(**known)


# The replica's side.


class PeerRateLimit:
    """A token bucket per peer: ``burst`` requests at once, then ``rate_per_s``.

    Only the ``max_peers`` most recently seen are remembered (one that comes back starts full):
    the map stays small whoever connects.
    """

    def __init__(
        self,
        burst: int,
        rate_per_s: float,
        clock: Callable[[], float] = time.monotonic,
        max_peers: int = 1024,
    ) -> None:
        self.burst = burst
        self.rate_per_s = rate_per_s
        self.max_peers = max_peers
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def allow(self, peer: str) -> bool:
        now = self._clock()
        tokens, last = self._buckets.pop(peer, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate_per_s)
        allowed = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        return allowed


class KvEventPublisher:
    """The replica's side: collects its engine's changes and publishes them once per step.

    The engine calls ``stored``/``removed``/``cleared``/``accepted`` as things happen and
    ``flush`` at the end of each scheduling step (one message per step, not per block). All of
    it runs on the replica's event loop, so a snapshot is always consistent with ``seq``.
    ``snapshot`` returns the engine's current cached block hashes: a list it will not touch
    again (the engines build one per call), or any collection, which is copied.

    ``keys``: the cluster's CURVE keypair (``serve_app/kvcache/curve.py``); None is plaintext,
    refused unless ``host`` is loopback. ``max_message_bytes`` is the routers' cap: a message
    that would exceed it is not sent (its ``seq`` is skipped, so routers resync) and a snapshot
    is cut to the blocks that fit.
    """

    def __init__(
        self,
        replica_id: str,
        snapshot: Callable[[], Collection[int]],
        host: str = "127.0.0.1",
        heartbeat_s: float = 1.0,
        *,
        keys: CurveKeys | None = None,
        pool: str = "",
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        snapshot_burst: int = 8,
        snapshot_rate_per_s: float = 2.0,
    ) -> None:
        if keys is None and not _is_loopback(host):
            raise ValueError(
                f"KV events would listen on {host} in plaintext: set routing.kv_events.auth to "
                "curve (the default) for any address beyond loopback"
            )
        self.replica_id = replica_id
        self._topic = replica_id.encode()
        self._snapshot = snapshot
        self._heartbeat_s = heartbeat_s
        self.max_message_bytes = max_message_bytes
        self._max_snapshot_blocks = (max_message_bytes - _SNAPSHOT_HEADROOM) // _BLOCK_BYTES
        self._limit = PeerRateLimit(snapshot_burst, snapshot_rate_per_s)
        self.epoch = random.getrandbits(63)
        self.seq = 0
        self._ops: list[list] = []
        self._accepted: list[str] = []
        self._load = EngineLoad()
        self._last_sent = 0.0
        self._encoded: tuple[int, bytes] | None = None  # the last snapshot: (seq, message)
        self._warned: set[str] = set()
        self.rejected: Counter[str] = Counter()  # what ``forge_kv_events_rejected_total`` says
        self._rejected = rejected_counter(pool)
        # One libzmq context, two faces: PUB is a plain socket (a send never waits, so it needs
        # no loop), the snapshot socket is served on the replica's loop. One context, so one
        # ZAP handler guards both.
        self._pub_ctx = zmq.Context()
        self._ctx = zmq.asyncio.Context.shadow(self._pub_ctx.underlying)
        self._gatekeeper = Gatekeeper(self._pub_ctx, keys) if keys is not None else None
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)  # a slow router loses messages, then resyncs
        self._rep = self._ctx.socket(zmq.ROUTER)
        # A router that never reads its replies holds a few, not a queue of whole snapshots.
        self._rep.setsockopt(zmq.SNDHWM, 4)
        self._rep.setsockopt(zmq.RCVHWM, 1_000)
        self._monitors: list[zmq.asyncio.Socket] = []
        for sock in (self._pub, self._rep):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
            if keys is not None:
                serve_curve(sock, keys)
                self._monitors.append(self._monitor(sock))
        pub_port = self._pub.bind_to_random_port(f"tcp://{host}")
        rep_port = self._rep.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{pub_port}"
        self.snapshot_endpoint = f"tcp://{host}:{rep_port}"
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Serve snapshots and heartbeats on the running loop."""
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self._serve_snapshots()),
                loop.create_task(self._beat()),
                *(loop.create_task(self._count_handshakes(m)) for m in self._monitors),
            ]

    def describe(self) -> dict:
        """For the replica's routing stats: where routers subscribe."""
        return {"endpoint": self.endpoint, "snapshot": self.snapshot_endpoint, "epoch": self.epoch}

    # The engine's calls.

    def stored(self, hashes: Iterable[int]) -> None:
        self._append(STORED, hashes)

    def removed(self, hashes: Iterable[int]) -> None:
        self._append(REMOVED, hashes)

    def cleared(self) -> None:
        self._ops.append([CLEARED])

    def accepted(self, request_id: str) -> None:
        """The engine took this request in: routers stop counting it as theirs in flight."""
        self._accepted.append(request_id)

    def flush(self, load: EngineLoad) -> None:
        """Publish what changed since the last flush (nothing changed, nothing sent)."""
        if not self._ops and not self._accepted and load == self._load:
            return
        self._load = load
        self._send()

    def _append(self, kind: str, hashes: Iterable[int]) -> None:
        hashes = list(hashes)
        if not hashes:
            return
        if self._ops and self._ops[-1][0] == kind:
            self._ops[-1][1].extend(hashes)
        else:
            self._ops.append([kind, hashes])

    def _send(self) -> None:
        self.seq += 1
        payload = {
            "v": WIRE_VERSION,
            "epoch": self.epoch,
            "seq": self.seq,
            "ts": time.time(),
            "ops": self._ops,
            "accepted": self._accepted,
            "load": asdict(self._load),
        }
        self._ops, self._accepted = [], []
        self._last_sent = time.monotonic()
        raw = encode(payload)
        if len(raw) > self.max_message_bytes:  # the routers would drop it and the connection
            self._warn_once("big", "KV events: a %d-byte message skipped; routers resync", len(raw))
            return
        with contextlib.suppress(zmq.Again):  # PUB never blocks; a full queue drops (resync)
            self._pub.send_multipart([self._topic, raw], flags=zmq.NOBLOCK)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_s)
            if time.monotonic() - self._last_sent >= self._heartbeat_s:
                self._send()

    async def _serve_snapshots(self) -> None:
        while True:
            frames = await self._rep.recv_multipart(copy=False)
            try:
                await self._answer(frames)
            except Exception:  # one request must not end the service
                logger.exception("KV events: a snapshot request failed")

    async def _answer(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2 or frames[-1].bytes != SNAPSHOT_REQUEST:
            self._reject("malformed")  # never answered: a stranger learns nothing
            return
        if not self._limit.allow(_peer(frames)):
            self._reject("rate_limited")  # its router asks again after its timeout
            return
        # Events not yet flushed are already in the engine's set: the router replays them
        # from the next message, harmlessly (see the module docstring).
        reply = await self._encoded_snapshot()
        await self._rep.send_multipart([*(f.bytes for f in frames[:-1]), reply])  # REQ or DEALER

    async def _encoded_snapshot(self) -> bytes:
        """The snapshot as of now, encoded in chunks between which the loop runs; the same
        bytes again while ``seq`` stands still (a snapshot at seq N followed by message N+1 is
        exact however late in N's interval it was taken)."""
        if self._encoded is not None and self._encoded[0] == self.seq:
            return self._encoded[1]
        seq, load = self.seq, asdict(self._load)
        blocks = self._snapshot()
        blocks = blocks if isinstance(blocks, list) else list(blocks)  # at seq: one copy
        if len(blocks) > self._max_snapshot_blocks:
            self._warn_once(
                "cut",
                "KV events: snapshot of %d blocks cut to the %d that fit the routers' cap",
                len(blocks),
                self._max_snapshot_blocks,
            )
            blocks = blocks[: self._max_snapshot_blocks]
        packer = msgpack.Packer(use_bin_type=True)
        parts = [packer.pack_map_header(5)]
        for key, value in (
            ("v", WIRE_VERSION),
            ("epoch", self.epoch),
            ("seq", seq),
            ("load", load),
        ):
            parts += (packer.pack(key), packer.pack(value))
        parts += (packer.pack("blocks"), packer.pack_array_header(len(blocks)))
        for start in range(0, len(blocks), _CHUNK):
            parts.append(_array_items(packer, blocks[start : start + _CHUNK]))
            await asyncio.sleep(0)
        raw = b"".join(parts)
        self._encoded = (seq, raw)
        return raw

    async def _count_handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        """A peer without the key fails CURVE's handshake (no key, another key, plaintext)."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] & _HANDSHAKE_FAILED:
                self._reject("unauthenticated")
                self._warn_once(
                    "auth",
                    "KV events: a peer without the cluster's key was refused (%s)",
                    event["endpoint"],
                )

    def _monitor(self, sock: zmq.Socket) -> zmq.asyncio.Socket:
        address = f"inproc://forge-kv-monitor-{id(self)}-{id(sock)}"
        sock.monitor(address, _HANDSHAKE_FAILED)
        monitor = self._ctx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.connect(address)
        return monitor

    def _reject(self, reason: str) -> None:
        self.rejected[reason] += 1
        self._rejected.inc(tags={"reason": reason})

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message + " (logged once per replica)", *args)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for sock in (self._pub, self._rep):
            if self._monitors:
                sock.disable_monitor()
            sock.close()
        for monitor in self._monitors:
            monitor.close()
        if self._gatekeeper is not None:
            self._gatekeeper.stop()
        self._pub_ctx.term()


def _array_items(packer: msgpack.Packer, items: list) -> bytes:
    """``items`` msgpack-encoded back to back, without their array's header: chunks of one
    array that is encoded in pieces."""
    packed = packer.pack(items)
    n = len(items)
    return packed[1 if n < 16 else 3 if n < 0x10000 else 5 :]


def _peer(frames: list[zmq.Frame]) -> str:
    """Who asks, for the rate limit: the peer's address (a DEALER's identity is new on every
    connection); its routing identity where the transport has no address."""
    try:
        return frames[-1].get("Peer-Address")
    except zmq.ZMQError:
        return frames[0].bytes.hex()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
