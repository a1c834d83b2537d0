"""What a pool's request router tells the gateway in the same process, without a round trip.

Serve's router knows which replicas a pool has (it is pushed every change) and which replica
each request went to; the gateway needs both: zero replicas means the pool is cold (serve from
the fallback at once, wake it in the background), and a failure must be charged to the replica
that failed even when it died before saying who it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_MAX_ROUTED = 10_000  # entries of requests nobody collected (cancelled callers): forget them


@dataclass(slots=True)
class PoolLedger:
    replica_ids: frozenset[str] | None = None  # None until Serve first told the router
    # request id → (replica id, whether the request is that replica's half-open probe)
    routed: dict[str, tuple[str, bool]] = field(default_factory=dict)
    # request id → the replica its first attempt failed on: its retry goes elsewhere
    avoid: dict[str, str] = field(default_factory=dict)

    def note_routed(self, request_id: str, replica_id: str, probe: bool) -> None:
        if len(self.routed) >= _MAX_ROUTED:
            self.routed.clear()
        self.routed[request_id] = (replica_id, probe)

    def take_routed(self, request_id: str) -> tuple[str, bool] | None:
        """Where an attempt went (once); its retry's ``avoid`` note is done with too."""
        self.avoid.pop(request_id, None)
        return self.routed.pop(request_id, None)


_ledgers: dict[str, PoolLedger] = {}


def ledger(pool: str) -> PoolLedger:
    book = _ledgers.get(pool)
    if book is None:
        book = _ledgers[pool] = PoolLedger()
    return book


def replica_backend(pool: str, replica_id: str) -> str:
    """A replica's name as a breaker backend (``primary/abc123``)."""
    return f"{pool}/{replica_id}"
