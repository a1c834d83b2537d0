"""Where a gateway replica and its pools' request routers meet, in one process, without a hop.

Serve builds a pool's ``RequestRouter`` itself, inside the process that holds the pool's handle
(the gateway replica), from a class path and keyword arguments: no object can be handed to it.
So the two sides need one agreed place to share state, and this module is that place, on
purpose and nowhere else. It is keyed by application and pool, so two Forge applications (or
two gateways in one test process) never see each other's state.

What crosses it, per pool:

- router → gateway: the replica ids Serve can route to now (zero means the pool is cold: serve
  from the fallback at once and wake it), and which replica each request went to (a failure is
  charged to that replica's breaker even when it died before saying who it was), or, until
  Serve says, the replicas it was offered (a request cancelled in between may have started on
  one of them, and is charged what it cost there);
- gateway → router: the replica a retry must avoid, the replica a follow-up call must reach
  (the usage of a stream the client left), and the gateway's breaker states, so an open
  replica is never chosen and a half-open one gets exactly its one probe.

``reset_bridges()`` forgets everything (tests that build several gateways in one process).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_app.resilience.client import BreakerClient

_MAX_ROUTED = 10_000  # entries of requests nobody collected (cancelled callers): forget them
_DEPLOYMENT_PREFIX = "pool-"


def pool_deployment_name(pool: str) -> str:
    """The Serve deployment of a pool, in whichever application it runs."""
    return _DEPLOYMENT_PREFIX + pool


def pool_of_deployment(deployment: str) -> str:
    return deployment.removeprefix(_DEPLOYMENT_PREFIX)


@dataclass(slots=True)
class PoolBridge:
    """One pool's shared state between the gateway and the pool's router."""

    replica_ids: frozenset[str] | None = None  # None until Serve first told the router
    # request id → (replica id, whether the request is that replica's half-open probe)
    routed: dict[str, tuple[str, bool]] = field(default_factory=dict)
    # request id → the replicas its router offered Serve, best first, until Serve hears which
    # took it (``routed``). Serve sends the request, then waits for the replica's word that it
    # accepted (``Router._route_and_send_request_once``): a request cancelled in that window may
    # have started on the replica without ever being noted as routed.
    offered: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # request id → the replica its first attempt failed on: its retry goes elsewhere
    avoid: dict[str, str] = field(default_factory=dict)
    # request id → the one replica a call about it must reach (the usage of its aborted stream)
    pinned: dict[str, str] = field(default_factory=dict)
    # The gateway's view of the breakers; None until a gateway in this process installs it.
    breakers: BreakerClient | None = None
    # The router's reading of what the replicas run (their engine identity, when they agree).
    engine_identity: Callable[[], str | None] | None = None

    def note_routed(self, request_id: str, replica_id: str, probe: bool) -> None:
        if len(self.routed) >= _MAX_ROUTED:
            self.routed.clear()
        self.routed[request_id] = (replica_id, probe)

    def note_offered(self, request_id: str, replica_ids: tuple[str, ...]) -> None:
        if len(self.offered) >= _MAX_ROUTED:
            self.offered.clear()
        self.offered[request_id] = replica_ids

    def take_routed(self, request_id: str) -> tuple[str, bool] | None:
        """Where an attempt went (once); its retry's ``avoid`` note is done with too."""
        self.avoid.pop(request_id, None)
        return self.routed.pop(request_id, None)

    def take_offered(self, request_id: str) -> tuple[str, ...]:
        """The replicas an attempt not (yet) noted as routed was offered to (once)."""
        return self.offered.pop(request_id, ())


class BridgedPool:
    """``PoolControl`` answered from the pool's bridge: the part both pool backends share (the
    one over a Serve handle, whose router keeps the bridge current, and the in-process one).
    A subclass provides ``wake``."""

    served_model: str | None = None  # the pool serves the requested model itself
    kinds = ("chat", "completion", "embedding")  # its model's task decides (stages/parse.py)

    def __init__(self, name: str, bridge: PoolBridge | None = None) -> None:
        self.name = name  # the pool's name: its breaker's, and its replicas' prefix
        self.bridge = bridge or PoolBridge()

    @property
    def pool(self) -> BridgedPool:
        return self

    def replica_count(self) -> int | None:
        """Replicas that can take a request now; None until the pool's router has heard."""
        ids = self.bridge.replica_ids
        return None if ids is None else len(ids)

    def avoid(self, request_id: str, replica_id: str) -> None:
        self.bridge.avoid[request_id] = replica_id

    def take_routed(self, request_id: str) -> tuple[str, bool] | None:
        return self.bridge.take_routed(request_id)

    def take_offered(self, request_id: str) -> tuple[str, ...]:
        return self.bridge.take_offered(request_id)

    def engine_identity(self) -> str | None:
        reported = self.bridge.engine_identity
        return None if reported is None else reported()


_bridges: dict[tuple[str, str], PoolBridge] = {}


def pool_bridge(app: str, pool: str) -> PoolBridge:
    """The bridge of ``pool`` in application ``app`` (created on first use by either side)."""
    bridge = _bridges.get((app, pool))
    if bridge is None:
        bridge = _bridges[(app, pool)] = PoolBridge()
    return bridge


def reset_bridges() -> None:
    _bridges.clear()


def replica_backend(pool: str, replica_id: str) -> str:
    """A replica's name as a breaker backend (``primary/abc123``)."""
    return f"{pool}/{replica_id}"
