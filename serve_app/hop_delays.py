"""How long a paced engine's stamped frame took to reach each hop of Forge's streaming path, for
the concurrency benchmark's breakdown of added inter-token latency (``loadtest.concurrency
--hops``): a client sees only the sum; this says which part of it grew.

Off unless ``FORGE_HOP_DELAYS`` names a directory when the process starts (the benchmark sets it
for its Forge; Ray's workers inherit it): then every hop's stamps (``engines/paced.py``: the
engine's CLOCK_MONOTONIC when it sent the token, one clock for every process of a machine) are
read as they pass, and each process appends, about once a second, ``(arrived, delay)`` pairs as
native doubles to ``<dir>/<hop>.<pid>.f64``. Off, a hop costs one module attribute test.
"""

from __future__ import annotations

import os
import time
from array import array
from pathlib import Path

from serve_app.engines.paced import SENT, STAMP

DIR = os.environ.get("FORGE_HOP_DELAYS") or None

# The hops, in the order a fed stream's frame passes them.
INTO_FEED = "replica-into-feed"  # the replica's stream handed it to its feed
FEED_OUT = "replica-feed-out"  # the feed's item left for the gateway (``Feed.items``)
GATEWAY_IN = "gateway-feed-in"  # the gateway read that item off the feed's handle stream
WRITTEN = "gateway-written"  # the gateway's server took it for the client's socket
HOPS = (INTO_FEED, FEED_OUT, GATEWAY_IN, WRITTEN)

FLUSH_EVERY_S = 1.0
_SENT = SENT.encode()
_pending: dict[str, array] = {}
_flushed = time.monotonic()


def note(hop: str, frames: object) -> None:
    """The stamps in ``frames`` (a frame's bytes, or a batch: a list of them and metadata) have
    reached ``hop`` now. Call only where ``DIR`` is set."""
    now = time.monotonic()
    pairs = _pending.get(hop)
    if pairs is None:
        pairs = _pending[hop] = array("d")
    for frame in frames if type(frames) is list else (frames,):
        if type(frame) is bytes:
            for marker, seconds in STAMP.findall(frame):
                if marker == _SENT:
                    pairs.append(now)
                    pairs.append(now - float(seconds))
    if now - _flushed >= FLUSH_EVERY_S:
        flush()


def flush() -> None:
    global _flushed
    _flushed = time.monotonic()
    assert DIR is not None
    for hop, pairs in _pending.items():
        if pairs:
            with open(Path(DIR) / f"{hop}.{os.getpid()}.f64", "ab") as f:
                pairs.tofile(f)
            del pairs[:]


def read(directory: Path, start: float, end: float) -> dict[str, list[float]]:
    """Each hop's delays (seconds) of the stamps that reached it within ``[start, end)``, from
    every process's files."""
    delays: dict[str, list[float]] = {}
    for path in directory.glob("*.f64"):
        hop = path.name.split(".", 1)[0]
        data = path.read_bytes()  # a writer may be mid-append: whole pairs only
        pairs = array("d")
        pairs.frombytes(data[: len(data) // 16 * 16])
        seen = delays.setdefault(hop, [])
        seen.extend(pairs[i + 1] for i in range(0, len(pairs), 2) if start <= pairs[i] < end)
    return delays
