"""The router's index of which replica caches which blocks, fed by the replicas' KV events.

One per pool in each gateway replica (the pool's ``ForgeRequestRouter`` owns it). A daemon
thread subscribes to every replica's publisher (``serve_app/kvcache/events.py``) and applies each
message as it arrives, so the index trails the engines by the transport's latency (about a
millisecond here; ``forge_kv_event_lag_seconds`` measures it). The router reads it on its own
loop: reads are single set and dict lookups, atomic under the GIL, and a resync swaps in a new
set rather than mutating the one being read.

Besides what the replicas say they hold, the index remembers what this router *sent*: a
request routed to a replica is counted in that replica's load (its uncached tokens) until the
replica's events say its engine took the request in, and its blocks count as held there for
``assign_ttl_s``, so the next request with the same new prompt follows it instead of
scattering before the replica's first event arrives ("assign it, then remember").

Memory per replica: one Python int per cached block in a set (about 70 bytes each; the
replica's cache size bounds it: ``max_blocks`` is a guard against a publisher that never
evicts), plus the in-flight assignments (``max_assignments``, each a tuple of at most
``route_blocks`` hashes).

Nothing a peer sends stops the thread: the sockets are CURVE clients of the cluster's key
(``serve_app/kvcache/curve.py``) with a size cap (``max_message_bytes``), and every message is
checked before it is applied (``parse_event``, ``parse_snapshot``). One that fails is skipped
and counted in ``forge_kv_events_rejected_total{reason}``: ``malformed``, ``version`` (a newer
replica's format during a roll: that replica is then routed by load alone), or
``unauthenticated`` (a publisher without the key: the handshake failed). A skipped event leaves
a gap in ``seq``, so the next good one brings a resync. A bigger message than the cap is
dropped by libzmq with its connection, before it is read, and libzmq does not reconnect after
such a protocol error: the index watches its subscriber's connections (a socket monitor) and
reconnects a replica whose connection dropped, then resyncs it (``resyncs{reason=reconnect}``).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import Counter as TallyCounter
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from serve_app.kvcache.curve import CurveKeys, connect_curve
from serve_app.kvcache.events import (
    CLEARED,
    DEFAULT_MAX_MESSAGE_BYTES,
    REMOVED,
    SNAPSHOT_REQUEST,
    STORED,
    BadMessage,
    EngineLoad,
    EventBatch,
    parse_event,
    parse_snapshot,
    rejected_counter,
)
from serve_app.metrics import counter, gauge, histogram

logger = logging.getLogger("ray.serve")

_POLL_MS = 20  # the longest a watch/forget command waits for the thread to pick it up
_SNAPSHOT_TIMEOUT_S = 2.0  # then ask again (the replica may have been busy or restarting)
_MAX_BUFFERED = 10_000  # messages held while a snapshot is on its way; more: resync again
_DRAIN_BATCH = 1_000  # messages read in a row before commands and snapshots get a turn
_MAX_WARNED = 1_000  # (replica, reason) pairs whose first rejection was logged as a warning
_RECONNECT_S = 1.0  # from a dropped connection to a replica to connecting it again
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


@dataclass
class _ReplicaState:
    endpoint: str
    snapshot_endpoint: str
    epoch: int | None = None
    seq: int = 0
    blocks: set[int] = field(default_factory=set)
    load: EngineLoad | None = None
    synced: bool = False
    resync: zmq.Socket | None = None
    resync_sent: float = 0.0
    buffered: list[EventBatch] = field(default_factory=list)
    buffered_blocks: int = 0  # hashes in ``buffered``: bounded like the index itself
    reconnect_at: float | None = None  # its connection dropped: connect again then


@dataclass(frozen=True, slots=True)
class _Assignment:
    replica_id: str
    tokens: int
    hashes: tuple[int, ...]
    expires: float


class KvIndex:
    """Which blocks each replica holds and what prefill work it has queued; see the module.

    ``keys``: the cluster's CURVE keypair, None for plaintext (replicas on loopback with
    ``routing.kv_events.auth: none``). ``rejected`` counts skipped messages by reason, in
    process (the Prometheus series says the same).
    """

    def __init__(
        self,
        pool: str,
        max_blocks: int = 1_000_000,
        assign_ttl_s: float = 5.0,
        max_assignments: int = 10_000,
        *,
        keys: CurveKeys | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self.keys = keys
        self.max_message_bytes = max_message_bytes
        self.rejected: TallyCounter[str] = TallyCounter()
        self._warned: set[tuple[str, str]] = set()
        self.assign_ttl_s = assign_ttl_s
        self.max_assignments = max_assignments
        self._replicas: dict[str, _ReplicaState] = {}
        self._watched: dict[str, str] = {}  # replica → endpoint asked for (the caller's side)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Requests this router sent and the replica has not yet taken in, oldest first.
        self._assigned: OrderedDict[str, _Assignment] = OrderedDict()
        self._assigned_tokens: dict[str, int] = {}
        self._assigned_blocks: dict[int, str] = {}  # block hash → replica of its latest send
        self._lock = threading.Lock()  # the assignment maps: written by both threads
        self._stop = threading.Event()
        self._lag = histogram(
            "forge_kv_event_lag_seconds",
            "From a replica publishing a KV event batch to this router applying it.",
            "pool",
            boundaries=[0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0],
        )
        self._events = counter(
            "forge_kv_events_total", "KV event messages applied, per pool.", "pool"
        )
        self._resyncs = counter(
            "forge_kv_resyncs_total",
            "Full resyncs of a replica's blocks (new replica, restart, lost message).",
            *("pool", "reason"),
        )
        self._blocks_gauge = gauge(
            "forge_kv_index_blocks",
            "Blocks the router's index holds for a replica.",
            *("pool", "target"),
        )
        for series in (self._lag, self._events, self._resyncs, self._blocks_gauge):
            series.set_default_tags({"pool": pool})
        self._rejected = rejected_counter(pool)
        self._thread = threading.Thread(target=self._run, name=f"kv-index-{pool}", daemon=True)
        self._thread.start()

    # The router's side (its event loop).

    def watch(self, replica_id: str, endpoint: str, snapshot_endpoint: str) -> None:
        """Subscribe to a replica (idempotent); its routing stats say where."""
        if self._watched.get(replica_id) != endpoint:
            self._watched[replica_id] = endpoint
            self._commands.put(("watch", replica_id, endpoint, snapshot_endpoint))

    def keep_only(self, replica_ids: Collection[str]) -> None:
        """Forget replicas that left the pool, and what was assigned to them."""
        for replica_id in list(self._watched):
            if replica_id not in replica_ids:
                del self._watched[replica_id]
                self._commands.put(("forget", replica_id))

    def watching(self, replica_id: str) -> bool:
        state = self._replicas.get(replica_id)
        return state is not None and state.synced

    def blocks(self, replica_id: str) -> Collection[int]:
        state = self._replicas.get(replica_id)
        return state.blocks if state is not None else frozenset()

    def holds(self, replica_id: str) -> Collection[int]:
        """Blocks the replica holds or was just sent: what a policy matches a prompt against."""
        return _Held(self.blocks(replica_id), self._assigned_blocks, replica_id)

    def load(self, replica_id: str) -> EngineLoad | None:
        state = self._replicas.get(replica_id)
        return state.load if state is not None else None

    def assigned_tokens(self, replica_id: str) -> int:
        """Uncached prompt tokens this router sent to the replica that its engine has not yet
        said it took in."""
        self._expire(time.monotonic())
        return self._assigned_tokens.get(replica_id, 0)

    def assign(self, request_id: str, replica_id: str, tokens: int, hashes: Sequence[int]) -> None:
        now = time.monotonic()
        assignment = _Assignment(replica_id, tokens, tuple(hashes), now + self.assign_ttl_s)
        with self._lock:
            self._drop(request_id)
            self._assigned[request_id] = assignment
            self._assigned_tokens[replica_id] = self._assigned_tokens.get(replica_id, 0) + tokens
            for h in assignment.hashes:
                self._assigned_blocks[h] = replica_id
            while len(self._assigned) > self.max_assignments:
                self._drop(next(iter(self._assigned)))
        self._expire(now)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    # Assignments.

    def _expire(self, now: float) -> None:
        if not self._assigned or next(iter(self._assigned.values())).expires > now:
            return
        with self._lock:
            while self._assigned:
                request_id, first = next(iter(self._assigned.items()))
                if first.expires > now:
                    break
                self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        """Under the lock: forget one assignment (its tokens and its remembered blocks)."""
        assignment = self._assigned.pop(request_id, None)
        if assignment is None:
            return
        rid = assignment.replica_id
        self._release_tokens(assignment)
        for h in assignment.hashes:
            if self._assigned_blocks.get(h) == rid:
                del self._assigned_blocks[h]

    def _release_tokens(self, assignment: _Assignment) -> None:
        """Under the lock: the assignment's tokens no longer count on its replica."""
        rid = assignment.replica_id
        left = self._assigned_tokens.get(rid, 0) - assignment.tokens
        if left > 0:
            self._assigned_tokens[rid] = left
        else:
            self._assigned_tokens.pop(rid, None)

    def _accepted(self, request_ids: list[str]) -> None:
        with self._lock:
            for engine_id in request_ids:
                # Engines name a request "<forge id>-<n>" (or "-<n>-<i>"): strip suffixes.
                candidate = engine_id
                for _ in range(3):
                    if candidate in self._assigned:
                        # The blocks stay remembered: the replica's own events now cover them,
                        # and the rest expires with the TTL.
                        assignment = self._assigned.pop(candidate)
                        self._assigned[candidate] = _Assignment(
                            assignment.replica_id, 0, assignment.hashes, assignment.expires
                        )
                        self._release_tokens(assignment)
                        break
                    candidate, _, _ = candidate.rpartition("-")
                    if not candidate:
                        break

    # The subscriber thread: everything below runs on it, and only there.

    def _run(self) -> None:
        self._ctx = zmq.Context()
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        # The subscriber's connections: libzmq reconnects after a network error, not after a
        # peer's protocol error (an oversized message, a failed handshake); the index does.
        self._sub.monitor("inproc://kv-index-monitor", zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED)
        self._sub_monitor = self._ctx.socket(zmq.PAIR)
        self._sub_monitor.setsockopt(zmq.LINGER, 0)
        self._sub_monitor.connect("inproc://kv-index-monitor")
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._sub_monitor, zmq.POLLIN)
        self._owners: dict[zmq.Socket, str] = {}  # snapshot socket → its replica
        try:
            while not self._stop.is_set():
                try:
                    self._step()
                except Exception:  # a bug, not a peer (their messages are checked): go on
                    logger.exception("KV index for pool %s: an iteration failed", self.pool)
                    self._stop.wait(_POLL_MS / 1000)  # a lasting fault must not spin
        finally:
            for sock in list(self._owners):
                sock.close()
            self._sub.disable_monitor()
            self._sub_monitor.close()
            self._sub.close()
            self._ctx.term()

    def _step(self) -> None:
        self._run_commands()
        for sock, _ in self._poller.poll(_POLL_MS):
            if sock is self._sub:
                self._drain()
            elif sock is self._sub_monitor:
                self._on_connection_event()
            else:
                self._on_snapshot(sock)
        self._retry_snapshots()
        self._reconnect()

    def _socket(self, kind: int) -> zmq.Socket:
        """A socket to the replicas: their key, and a cap on what it takes in."""
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        if self.keys is not None:
            connect_curve(sock, self.keys)
        return sock

    def _drain(self) -> None:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            replica_id = "?"
            try:
                if len(frames) != 2:
                    raise BadMessage("malformed", f"{len(frames)} frames, not 2")
                replica_id = frames[0].decode()
                batch = parse_event(frames[1])
            except (BadMessage, UnicodeDecodeError) as exc:
                self._reject(replica_id, exc)
                continue
            self._on_message(replica_id, batch)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            replica_id = command[1]
            old = self._replicas.pop(replica_id, None)
            if old is not None:
                self._close_resync(old)
                with contextlib.suppress(zmq.ZMQError):  # a connection libzmq ended itself
                    self._sub.disconnect(old.endpoint)
            if command[0] == "watch":
                state = _ReplicaState(endpoint=command[2], snapshot_endpoint=command[3])
                self._replicas[replica_id] = state
                self._sub.connect(state.endpoint)
                self._request_snapshot(replica_id, state)  # an idle replica sends nothing
                continue
            self._blocks_gauge.set(0, tags={"target": replica_id})
            with self._lock:
                for request_id in [
                    r for r, a in self._assigned.items() if a.replica_id == replica_id
                ]:
                    self._drop(request_id)

    def _reject(self, replica_id: str, exc: Exception) -> None:
        reason = exc.reason if isinstance(exc, BadMessage) else "malformed"
        self.rejected[reason] += 1
        self._rejected.inc(tags={"reason": reason})
        key = (replica_id, reason)
        first = key not in self._warned and len(self._warned) < _MAX_WARNED
        self._warned.add(key)
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "KV index for pool %s: skipped a message from replica %s (%s): %s",
            *(self.pool, replica_id, reason, exc),
        )

    def _on_message(self, replica_id: str, msg: EventBatch) -> None:
        state = self._replicas.get(replica_id)
        if state is None:
            return  # not (or no longer) one of this pool's replicas
        self._accepted(msg.accepted)
        if state.resync is not None:
            size = sum(len(hashes) for _, hashes in msg.ops)
            if len(state.buffered) < _MAX_BUFFERED and state.buffered_blocks < self.max_blocks:
                state.buffered.append(msg)
                state.buffered_blocks += size
            return  # else lost: its gap brings another resync
        if msg.epoch != state.epoch or msg.seq != state.seq + 1:
            self._resyncs.inc(tags={"reason": "restart" if msg.epoch != state.epoch else "gap"})
            self._request_snapshot(replica_id, state)
            state.buffered = [msg]
            state.buffered_blocks = sum(len(hashes) for _, hashes in msg.ops)
            return
        self._apply(replica_id, state, msg)

    def _apply(self, replica_id: str, state: _ReplicaState, msg: EventBatch) -> None:
        blocks = state.blocks
        for kind, hashes in msg.ops:
            if kind == STORED:
                if len(blocks) < self.max_blocks:
                    blocks.update(hashes)
            elif kind == REMOVED:
                blocks.difference_update(hashes)
            elif kind == CLEARED:
                state.blocks = blocks = set()
        state.seq = msg.seq
        state.load = msg.load
        self._events.inc()
        if msg.ops:
            self._blocks_gauge.set(len(state.blocks), tags={"target": replica_id})
        self._lag.observe(max(0.0, time.time() - msg.ts))

    def _on_connection_event(self) -> None:
        while True:
            try:
                event = parse_monitor_message(self._sub_monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            endpoint = event["endpoint"].decode()
            found = [(r, s) for r, s in self._replicas.items() if s.endpoint == endpoint]
            if not found:
                continue  # a replica already forgotten
            replica_id, state = found[0]
            if event["event"] & _HANDSHAKE_FAILED:
                why = "its publisher does not hold the cluster's key (CURVE handshake failed)"
                self._reject(replica_id, BadMessage("unauthenticated", why))
            elif state.reconnect_at is None:
                state.reconnect_at = time.monotonic() + _RECONNECT_S

    def _reconnect(self) -> None:
        """Connect again to replicas whose connection dropped; what was lost meanwhile comes
        back with a snapshot."""
        now = time.monotonic()
        for replica_id, state in self._replicas.items():
            if state.reconnect_at is None or state.reconnect_at > now:
                continue
            state.reconnect_at = None
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disconnect(state.endpoint)
            self._sub.connect(state.endpoint)
            self._resyncs.inc(tags={"reason": "reconnect"})
            self._request_snapshot(replica_id, state)

    def _request_snapshot(self, replica_id: str, state: _ReplicaState) -> None:
        self._close_resync(state)
        sock = self._socket(zmq.DEALER)
        sock.connect(state.snapshot_endpoint)
        sock.send(SNAPSHOT_REQUEST, zmq.NOBLOCK)
        self._poller.register(sock, zmq.POLLIN)
        self._owners[sock] = replica_id
        state.resync = sock
        state.resync_sent = time.monotonic()

    def _on_snapshot(self, sock: zmq.Socket) -> None:
        replica_id = self._owners.get(sock)
        state = self._replicas.get(replica_id) if replica_id is not None else None
        raw = sock.recv()
        if state is None or state.resync is not sock:
            self._poller.unregister(sock)
            self._owners.pop(sock, None)
            sock.close()
            return
        try:
            snap = parse_snapshot(raw, self.max_blocks)
        except BadMessage as exc:  # asked again after the timeout (a newer replica: each time)
            self._reject(replica_id, exc)
            return
        self._close_resync(state)
        state.epoch, state.seq = snap.epoch, snap.seq
        pending, state.buffered, state.buffered_blocks = state.buffered, [], 0
        state.blocks = snap.blocks  # one swap, never half-built
        state.load = snap.load
        state.synced = True
        replay = sorted(
            (m for m in pending if m.epoch == state.epoch and m.seq > state.seq),
            key=lambda m: m.seq,
        )
        for msg in replay:
            if msg.seq != state.seq + 1:  # lost while we waited: once more
                self._resyncs.inc(tags={"reason": "gap"})
                self._request_snapshot(replica_id, state)
                state.buffered = [m for m in replay if m.seq > state.seq]
                state.buffered_blocks = sum(len(h) for m in state.buffered for _, h in m.ops)
                return
            self._apply(replica_id, state, msg)
        self._blocks_gauge.set(len(state.blocks), tags={"target": replica_id})

    def _retry_snapshots(self) -> None:
        now = time.monotonic()
        for replica_id, state in self._replicas.items():
            if state.resync is not None and now - state.resync_sent > _SNAPSHOT_TIMEOUT_S:
                self._request_snapshot(replica_id, state)

    def _close_resync(self, state: _ReplicaState) -> None:
        sock, state.resync = state.resync, None
        if sock is not None:
            self._poller.unregister(sock)
            self._owners.pop(sock, None)
            sock.close()


class _Held(Collection[int]):
    """A replica's blocks plus those this router just sent it, without copying either."""

    __slots__ = ("_assigned", "_blocks", "_replica_id")

    def __init__(self, blocks: Collection[int], assigned: dict[int, str], replica_id: str):
        self._blocks = blocks
        self._assigned = assigned
        self._replica_id = replica_id

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks or self._assigned.get(block_hash) == self._replica_id

    def __iter__(self):
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)
