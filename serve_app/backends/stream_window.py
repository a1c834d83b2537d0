"""How much of a pool's stream the gateway's gRPC channels may hold for a caller not reading.

In throughput-optimized mode a Serve handle stream is a gRPC call, and the gateway pulls its
messages only as its client takes the bytes. What gRPC receives meanwhile waits in the channel,
up to the HTTP/2 stream window the gateway announced; gRPC grows that window by its
bandwidth-delay probe, and on a fast link it grew to most of a long generation (~0.8 MiB for a
6 000-token stream, ``loadtest/slow_readers.py``). Token streams need no such window: a fast
one is tens of KiB a second. So the gateway's channels to replicas announce a fixed window,
and a slow reader's stream waits in the replica (bounded there, ``Replica``), not here.

Serve has no setting for its channels' options; ``bound_stream_windows`` wraps the one function
its replica client opens channels with (``replica_wrapper.init_grpc_channel``) and adds two:
no bandwidth-delay probing, and ``STREAM_WINDOW_BYTES`` of lookahead per stream. On a Ray
without that function it changes nothing and says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger("ray.serve")

# Per stream: ~1,000 frames of a chat stream. A request's own stream carries its first batch
# and little else once its gateway holds a feed open to the replica (``replica/feed.py``); the
# feed carries every stream's frames, and its throughput is at most this window per round trip
# of the two event loops: ~2.5 MB/s for 2,000 streams of 5 tokens/s, which a 64 KiB window
# carries only while both loops answer within ~25 ms. (A feed at 64 KiB, its items not yet
# bounded, stalled with the machine's load at 30: docs/benchmarks.md, "Feeds"; which of the
# two caused it was not measured.)
STREAM_WINDOW_BYTES = 256 * 1024
OPTIONS = (("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES))


def bound_stream_windows() -> bool:
    """Make this process's new channels to Serve replicas announce a fixed window (once; later
    calls are no-ops). False where this Ray has no such function to wrap."""
    try:
        from ray.serve._private.request_router import replica_wrapper
    except ImportError:
        replica_wrapper = None
    opener = getattr(replica_wrapper, "init_grpc_channel", None)
    if opener is None:
        logger.warning("Serve's replica channels are not reachable: stream windows unbounded")
        return False
    if getattr(opener, "forge_bounded", False):
        return True
    replica_wrapper.init_grpc_channel = _bounded(opener)
    return True


def _bounded(opener: Callable) -> Callable:
    def init_grpc_channel(address, options=None, *args, **kwargs):
        return opener(address, [*(options or ()), *OPTIONS], *args, **kwargs)

    init_grpc_channel.forge_bounded = True  # type: ignore[attr-defined]
    return init_grpc_channel
