"""Every socket the session's Ray and Forge processes listen on, accounted for; and the only ones
that listen beyond loopback, the replicas' inter-deployment gRPC servers, refuse a call that
lacks the cluster's token.

What listens comes from the kernel (``psutil.net_connections``), for the processes this session's
``ray.init`` started (GCS, raylet, dashboard, monitor, log monitor) and all their descendants
(agents, workers, replicas). What each socket is comes from Ray and Serve themselves: the GCS's
node table (raylet and agent ports) and worker table (each worker's core gRPC port, by pid),
Serve's controller (its proxy's HTTP port, the direct-ingress targets, each running replica's
gRPC port, and where a kv_aware pool's replicas publish their KV events). ``EXPECTED`` lists
every role and whether it may bind beyond loopback; a socket of no known role fails the test, as
does any but a replica's gRPC server or KV-event sockets on a non-loopback address.
docs/listeners.md is the same table for people.

Ray 2.60 binds each replica's inter-deployment gRPC server to ``[::]:0`` (every interface, a
random port; ``serve/_private/replica.py``) with no setting to change it, and the server
unpickles each request's metadata. What guards it is Ray's token authentication, which
``ray.init`` turns on for a new local cluster (here, and for ``serve run configs/local.yaml``)
unless ``RAY_AUTH_MODE`` says otherwise: the server's interceptor refuses a call without the
token (UNAUTHENTICATED). A pool replica is thus out of reach of anyone who would skip Forge's
auth and quotas. The server runs in every replica whether or not handles use gRPC (they do
here: tests/conftest.py sets ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``, which makes gRPC Serve's
default transport between deployments).

The suite runs Serve's Python proxy, not HAProxy: HAProxy's listeners (configs/local.yaml) are
checked by scripts/smoke_local.py and tests/tools/test_haproxy_loopback.py, and a ``haproxy`` socket
here would be of no known role. The driver (this pytest process) is left out: other tests start
their own servers in it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.conftest import APP
from tests.polling import eventually

pytestmark = pytest.mark.e2e

POOL = "pool-primary"  # the primary pool's deployment (serve_app/app.py names it pool-<name>)
# A replica's inter-deployment gRPC service (ray/serve/generated/serve_pb2_grpc.py).
HANDLE_REQUEST = "/ray.serve.ASGIService/HandleRequest"


@dataclass(frozen=True)
class Role:
    owner: str  # the title of the process that opens it (a prefix: "ray::ServeReplica:")
    beyond_loopback: bool  # may bind more than loopback
    source: str  # where Ray or Serve says its port is


# Every role a listening socket of the session may have. docs/listeners.md, for people.
EXPECTED: dict[str, Role] = {
    "GCS": Role("gcs_server", False, "the driver's node: gcs_address"),
    "raylet: node manager": Role("raylet", False, "GCS node table: NodeManagerPort"),
    "raylet: object manager": Role("raylet", False, "GCS node table: ObjectManagerPort"),
    "dashboard agent: gRPC": Role("ray::DashboardAgent", False, "node table: MetricsAgentPort"),
    "dashboard agent: HTTP": Role(
        "ray::DashboardAgent", False, "node table: DashboardAgentListenPort"
    ),
    "metrics export (Prometheus)": Role(
        "ray::DashboardAgent", False, "node table: MetricsExportPort"
    ),
    "runtime env agent": Role("ray::RuntimeEnvAgent", False, "node table: RuntimeEnvAgentPort"),
    "autoscaler monitor metrics": Role("monitor.py", False, "AUTOSCALER_METRIC_PORT"),
    "dashboard metrics": Role("dashboard.py", False, "DASHBOARD_METRIC_PORT"),
    "dashboard HTTP": Role("dashboard.py", False, "the node's webui_url (none here)"),
    "core worker gRPC": Role("ray::", False, "GCS worker table: the worker's pid and port"),
    "Serve proxy HTTP": Role("ray::ProxyActor", False, "controller: get_http_config"),
    "Serve proxy gRPC": Role("ray::ProxyActor", False, "controller: get_grpc_config"),
    "direct ingress": Role("ray::ServeReplica:", False, "controller: get_target_groups"),
    "replica gRPC (inter-deployment)": Role(
        "ray::ServeReplica:", True, "controller: running replicas' port"
    ),
    # A kv_aware pool's replicas publish their KV events (serve_app/kvcache/events.py) on the node's
    # address, which routers in other pods must reach: loopback here, the pod's IP on a cluster.
    "KV events: publisher": Role("ray::ServeReplica:", True, "replica's routing stats"),
    "KV events: snapshot": Role("ray::ServeReplica:", True, "replica's routing stats"),
}


@dataclass(frozen=True)
class Listener:
    pid: int
    title: str  # the process's title: "raylet", "ray::ServeReplica:forge:pool-primary", ...
    transport: str  # "tcp" (listening) or "udp" (bound, not connected)
    ip: str
    port: int

    @property
    def loopback(self) -> bool:
        address = ipaddress.ip_address(self.ip.split("%")[0])
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback

    def __str__(self) -> str:
        return f"{self.transport} {self.ip}:{self.port} ({self.title}, pid {self.pid})"


def title(process) -> str:
    """What the process is: Ray workers and agents set a title (``ray::...``); Ray's Python
    services are their script's name; binaries (gcs_server, raylet, haproxy) their own name."""
    argv = process.cmdline()
    if not argv:
        return process.name()
    if argv[0].startswith("ray::"):
        return argv[0].split()[0]
    scripts = [Path(a).name for a in argv if a.endswith(".py")]
    return scripts[0] if scripts else Path(argv[0]).name


def session_processes() -> dict[int, str]:
    """pid -> title of every process this session's ray.init started, and their descendants."""
    import psutil
    import ray

    node = ray._private.worker._global_node
    roots = [info.process.pid for infos in node.all_processes.values() for info in infos]
    found: dict[int, str] = {}
    for pid in roots:
        try:
            root = psutil.Process(pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for process in family:
            try:
                found[process.pid] = title(process)
            except psutil.NoSuchProcess:
                pass
    found.pop(os.getpid(), None)
    return found


def listening(processes: dict[int, str]) -> list[Listener]:
    """The processes' listening TCP sockets and bound, unconnected UDP sockets."""
    import psutil

    found = []
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid not in processes:
            continue
        if conn.type == socket.SOCK_STREAM and conn.status != psutil.CONN_LISTEN:
            continue
        if conn.type == socket.SOCK_DGRAM and conn.raddr:
            continue
        transport = "tcp" if conn.type == socket.SOCK_STREAM else "udp"
        found.append(
            Listener(conn.pid, processes[conn.pid], transport, conn.laddr.ip, conn.laddr.port)
        )
    return sorted(found, key=lambda x: (x.title, x.port))


@dataclass(frozen=True)
class Known:
    """A port Ray or Serve knows of: its role, and the process that must hold it."""

    role: str
    pid: int | None = None  # when the source names the process (workers)
    title: str | None = None  # when it names what the process is (replicas, by app and name)


def controller():
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


def running_replicas() -> dict:
    """DeploymentID -> the RunningReplicaInfos Serve routes to (each with its gRPC port)."""
    import ray

    return ray.get(controller()._all_running_replicas.remote(), timeout=30)


def replica_title(deployment_id) -> str:
    return f"ray::ServeReplica:{deployment_id.app_name}:{deployment_id.name}"


def known_ports() -> dict[int, Known]:
    """Every port of this node that Ray or Serve knows, by port."""
    import ray
    from ray.autoscaler._private.constants import AUTOSCALER_METRIC_PORT
    from ray.core.generated import gcs_pb2
    from ray.dashboard.consts import DASHBOARD_METRIC_PORT

    node = ray._private.worker._global_node
    known: dict[int, Known] = {
        int(node.gcs_address.rsplit(":", 1)[1]): Known("GCS"),
        AUTOSCALER_METRIC_PORT: Known("autoscaler monitor metrics"),
        DASHBOARD_METRIC_PORT: Known("dashboard metrics"),
    }
    if webui := node.address_info.get("webui_url"):
        known[int(webui.rsplit(":", 1)[1])] = Known("dashboard HTTP")
    (info,) = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] == node.node_id]
    for field, role in {
        "NodeManagerPort": "raylet: node manager",
        "ObjectManagerPort": "raylet: object manager",
        "MetricsAgentPort": "dashboard agent: gRPC",
        "DashboardAgentListenPort": "dashboard agent: HTTP",
        "MetricsExportPort": "metrics export (Prometheus)",
        "RuntimeEnvAgentPort": "runtime env agent",
    }.items():
        known[int(info[field])] = Known(role)
    # Each worker's core gRPC server, as the worker registered it with the GCS.
    accessor = ray._private.state.state._connect_and_get_accessor()
    for raw in accessor.get_worker_table():
        worker = gcs_pb2.WorkerTableData.FromString(raw)
        if worker.is_alive and worker.worker_address.port:
            known[worker.worker_address.port] = Known("core worker gRPC", pid=worker.pid)

    serve = controller()
    http = ray.get(serve.get_http_config.remote(), timeout=30)
    known[http.port] = Known("Serve proxy HTTP")
    grpc_options = ray.get(serve.get_grpc_config.remote(), timeout=30)
    if grpc_options.grpc_servicer_functions:
        known[grpc_options.port] = Known("Serve proxy gRPC")
    for group in ray.get(serve.get_target_groups.remote(None, True), timeout=30):
        for target in group.targets:
            if target.name.startswith("SERVE_REPLICA::"):
                app, deployment = target.name.removeprefix("SERVE_REPLICA::").split("#")[:2]
                owner = f"ray::ServeReplica:{app}:{deployment}"
                known[target.port] = Known("direct ingress", title=owner)
    for deployment_id, replicas in running_replicas().items():
        for replica in replicas:
            owner = replica_title(deployment_id)
            if replica.port:
                known[replica.port] = Known("replica gRPC (inter-deployment)", title=owner)
            where = (replica.routing_stats or {}).get("kv_events") or {}
            kv_roles = (("endpoint", "KV events: publisher"), ("snapshot", "KV events: snapshot"))
            for key, role in kv_roles:
                if key in where:
                    known[int(where[key].rsplit(":", 1)[1])] = Known(role, title=owner)
    return known


@dataclass(frozen=True)
class Survey:
    listeners: tuple[Listener, ...]
    roles: dict[Listener, str]  # the listeners accounted for

    @property
    def unknown(self) -> list[Listener]:
        return [x for x in self.listeners if x not in self.roles]

    @property
    def exposed(self) -> list[str]:
        """Listeners beyond loopback whose role may not be."""
        return [
            f"{listener}: {role}"
            for listener, role in self.roles.items()
            if not listener.loopback and not EXPECTED[role].beyond_loopback
        ]

    def table(self) -> str:
        return "\n".join(f"  {x}: {self.roles.get(x, 'UNKNOWN')}" for x in self.listeners)


def role_of(listener: Listener, known: dict[int, Known]) -> str | None:
    """The listener's role, if Ray or Serve knows its port and the right process holds it."""
    entry = known.get(listener.port)
    if entry is None or listener.transport != "tcp":
        return None
    if entry.pid is not None and entry.pid != listener.pid:
        return None
    if entry.title is not None:
        return entry.role if listener.title == entry.title else None
    return entry.role if listener.title.startswith(EXPECTED[entry.role].owner) else None


def survey() -> Survey:
    """Sockets first, then what Ray and Serve know: a worker or replica that starts in between
    is unknown this time (and known the next), never known and missed."""
    listeners = listening(session_processes())
    known = known_ports()
    roles = {x: role for x in listeners if (role := role_of(x, known)) is not None}
    return Survey(tuple(listeners), roles)


def settled_survey() -> Survey:
    """A survey with every socket accounted for: a replica Serve is still starting or already
    stopping (a direct-ingress replica is held 5 s: tests/conftest.py) holds its ports without
    being listed."""
    last: list[Survey] = []

    def accounted() -> Survey | None:
        last[:] = [survey()]
        return None if last[0].unknown else last[0]

    return eventually(
        accounted,
        timeout_s=90,
        interval_s=1.0,
        what="every listening socket of the session's Ray processes to have a known role",
        explain=lambda: "\n" + last[0].table() if last else None,
    )


def test_every_listener_is_accounted_for_and_only_replica_grpc_leaves_loopback(forge_url):
    found = settled_survey()
    seen = set(found.roles.values())
    # The survey saw what the graph must have (else it looked in the wrong place).
    for role in (
        "GCS",
        "raylet: node manager",
        "core worker gRPC",
        "Serve proxy HTTP",
        "direct ingress",
        "replica gRPC (inter-deployment)",
        "KV events: publisher",  # the kv-aware routing pool's replicas
        "KV events: snapshot",
    ):
        assert role in seen, f"no {role} listener found:\n{found.table()}"
    assert found.exposed == [], "\n" + found.table()
    # Every running replica's gRPC server is one of them, on every interface as Ray binds it.
    grpc_ports = {x.port: x for x, role in found.roles.items() if role.startswith("replica gRPC")}
    for deployment_id, replicas in running_replicas().items():
        for replica in replicas:
            listener = grpc_ports.get(replica.port)
            if listener is not None:  # else the replica started after the survey
                assert not listener.loopback, f"{deployment_id}: {listener}"


def test_role_of_refuses_a_socket_nobody_accounts_for():
    """The classifier's negative cases: an unknown port, a known port held by another process
    (a worker's port under another pid, a replica's port in another deployment's replica)."""
    known = {
        1001: Known("core worker gRPC", pid=10),
        1002: Known("replica gRPC (inter-deployment)", title="ray::ServeReplica:forge:pool-a"),
        1003: Known("GCS"),
    }

    def at(port: int, title: str = "ray::IDLE", pid: int = 10) -> Listener:
        return Listener(pid, title, "tcp", "127.0.0.1", port)

    assert role_of(at(1001), known) == "core worker gRPC"
    assert role_of(at(1001, pid=11), known) is None
    assert role_of(at(9999), known) is None
    replica = "ray::ServeReplica:forge:pool-a"
    assert role_of(at(1002, replica), known) == "replica gRPC (inter-deployment)"
    assert role_of(at(1002, "ray::ServeReplica:forge:pool-ab"), known) is None
    assert role_of(at(1003, "raylet"), known) is None
    assert role_of(at(1003, "gcs_server"), known) == "GCS"
    listener = Listener(1, "gcs_server", "tcp", "0.0.0.0", 1003)
    exposed = Survey((listener,), {listener: "GCS"}).exposed
    assert exposed == ["tcp 0.0.0.0:1003 (gcs_server, pid 1): GCS"]
    mapped = Listener(1, "gcs_server", "tcp", "::ffff:127.0.0.1", 1003)
    assert Survey((mapped,), {mapped: "GCS"}).exposed == []


def test_a_pool_replica_refuses_grpc_without_the_cluster_token(forge_url):
    """A direct call to a pool replica's inter-deployment gRPC server: refused without the token
    and with a wrong one; with the token, the same call gets past authentication to the handler,
    which fails on the empty request (so the refusal is the token check, nothing else)."""
    import grpc
    from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, get_authentication_mode
    from ray.serve._private.common import DeploymentID

    assert get_authentication_mode() == AuthenticationMode.TOKEN, (
        f"the session's Ray runs without token authentication "
        f"(RAY_AUTH_MODE={os.environ.get('RAY_AUTH_MODE')!r}): its replicas' gRPC servers, on "
        "every interface, would take anyone's calls"
    )
    replicas = running_replicas()[DeploymentID(name=POOL, app_name=APP)]
    assert replicas and replicas[0].port, f"{POOL} lists no running replica with a gRPC port"
    target = f"127.0.0.1:{replicas[0].port}"  # the server is on every interface; loopback here
    token = AuthenticationTokenLoader.instance().get_raw_token(ignore_auth_mode=True)

    def status(metadata) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(target) as channel:
            call = channel.unary_unary(HANDLE_REQUEST)  # raw bytes in, raw bytes out
            with pytest.raises(grpc.RpcError) as refused:
                call(b"", metadata=metadata, timeout=10)
        return refused.value.code(), refused.value.details() or ""

    assert status(None)[0] == grpc.StatusCode.UNAUTHENTICATED
    assert status([("authorization", "Bearer not-the-cluster-token")])[0] == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    code, details = status([("authorization", f"Bearer {token}")])
    assert code == grpc.StatusCode.UNKNOWN and "EOFError" in details, (code, details)
