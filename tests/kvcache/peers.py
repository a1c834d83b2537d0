"""Peers of the KV-event sockets for tests: real ZeroMQ sockets on 127.0.0.x, no Ray.

``RawPeer`` is whatever else may be on the network: a replica of a newer version, a buggy one,
or a stranger, bound as a CURVE server with the cluster's key (or another key, or none). It
sends any frames it is told to, answers snapshot requests with any bytes it is told to, and,
being an XPUB, sees its subscribers come and go: a router that drops its connection (an
oversized message) shows as an unsubscribe followed by a new subscribe.
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from serve_app.kvcache.curve import CurveKeys, Gatekeeper, connect_curve, serve_curve
from serve_app.kvcache.events import EngineLoad, KvEventPublisher, decode, encode

SUBSCRIBE, UNSUBSCRIBE = b"\x01", b"\x00"


class RawPeer:
    def __init__(self, keys: CurveKeys | None, host: str = "127.0.0.1") -> None:
        self._ctx = zmq.asyncio.Context()
        self._gatekeeper = Gatekeeper(self._ctx, keys) if keys is not None else None
        self.pub = self._ctx.socket(zmq.XPUB)
        self.rep = self._ctx.socket(zmq.ROUTER)
        for sock in (self.pub, self.rep):
            sock.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                serve_curve(sock, keys)
        self.endpoint = f"tcp://{host}:{self.pub.bind_to_random_port(f'tcp://{host}')}"
        self.snapshot_endpoint = f"tcp://{host}:{self.rep.bind_to_random_port(f'tcp://{host}')}"
        self.snapshot_reply: bytes | None = None  # None: requests go unanswered
        self.snapshot_requests = 0
        self._task = asyncio.get_running_loop().create_task(self._answer())

    async def subscription(self, timeout_s: float = 10.0) -> bytes:
        """The next (un)subscription a subscriber sends: ``SUBSCRIBE`` or ``UNSUBSCRIBE``."""
        frame = await asyncio.wait_for(self.pub.recv(), timeout_s)
        return frame[:1]

    def send(self, *frames: bytes) -> None:
        self.pub.send_multipart(list(frames))

    async def _answer(self) -> None:
        while True:
            frames = await self.rep.recv_multipart()
            self.snapshot_requests += 1
            if self.snapshot_reply is not None:
                await self.rep.send_multipart([*frames[:-1], self.snapshot_reply])

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.pub.close()
        self.rep.close()
        if self._gatekeeper is not None:
            self._gatekeeper.stop()
        self._ctx.term()


def event(epoch: int, seq: int, stored: list[int] = (), **overrides) -> bytes:
    """An event message as a replica of this version sends it, with any field replaced."""
    payload = {
        "v": 1,
        "epoch": epoch,
        "seq": seq,
        "ts": 0.0,
        "ops": [["s", list(stored)]] if stored else [],
        "accepted": [],
        "load": {"backlog": 0, "running": 0, "waiting": 0, "slots": 1},
        **overrides,
    }
    return encode(payload)


def snapshot(epoch: int, seq: int, blocks: list[int] = (), **overrides) -> bytes:
    load = {"backlog": 0, "running": 0, "waiting": 0, "slots": 1}
    return encode(
        {"v": 1, "epoch": epoch, "seq": seq, "blocks": list(blocks), "load": load, **overrides}
    )


class Client:
    """A router's sockets, by hand: ``keys`` None is a plaintext peer; ``server_key`` the
    replica's public key, if not ``keys``' own (a stranger who knows it: it is public).
    ``source`` is the local address it connects from (``127.0.0.2``: another host, as the
    replica's rate limit sees it)."""

    def __init__(
        self,
        keys: CurveKeys | None,
        source: str | None = None,
        server_key: bytes | None = None,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._keys = keys
        self._server_key = server_key
        self._source = source
        self.sockets: list[zmq.asyncio.Socket] = []

    def socket(self, kind: int, endpoint: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            connect_curve(sock, self._keys)
            if self._server_key is not None:
                sock.curve_serverkey = self._server_key
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        host_port = endpoint.removeprefix("tcp://")
        sock.connect(f"tcp://{self._source}:0;{host_port}" if self._source else endpoint)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()
        self._ctx.term()


async def receive(sock: zmq.asyncio.Socket, timeout_s: float) -> list[bytes] | None:
    """The next message, or None if none comes within ``timeout_s``."""
    if await sock.poll(timeout_s * 1000):
        return await sock.recv_multipart()
    return None


async def first_event(publisher: KvEventPublisher, sub: zmq.asyncio.Socket) -> dict:
    """Publish (a changed load each time) until ``sub``, subscribed to ``publisher``, has one:
    a subscription takes a moment to reach a PUB, which drops what it sends before."""
    for backlog in range(1, 1_000):
        publisher.flush(EngineLoad(backlog=backlog))
        frames = await receive(sub, 0.05)
        if frames is not None:
            return decode(frames[1])
    raise AssertionError("the subscriber never got an event")
