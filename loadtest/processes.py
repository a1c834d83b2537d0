"""Which part of a Forge graph a process is, from its command line: Ray names its workers
``ray::<actor>`` and a Serve replica ``ray::ServeReplica:<app>:<deployment>``; Ray's daemons
and the dashboard's helpers are known by their scripts. The soak judges memory growth by these
roles and ``loadtest.memory`` reads the idle graph's memory by them."""

from __future__ import annotations

import re
from collections.abc import Sequence

_REPLICA = re.compile(r"^ray::ServeReplica:([^:\s]+):([^.\s]+)")
_ACTOR = re.compile(r"^ray::([A-Za-z_]+)")
_ACTOR_ROLES = {
    "ProxyActor": "proxy",
    "ServeController": "controller",
    "DashboardAgent": "dashboard-agent",
    "RuntimeEnvAgent": "runtime-env-agent",
    "IDLE": "idle-worker",
}
_BINARY_ROLES = {"gcs_server": "gcs", "raylet": "raylet"}
_SCRIPT_ROLES = (
    # The dashboard's head modules run in processes forked from a forkserver of its own.
    ("ray-dashboard-", "dashboard-modules"),
    ("multiprocessing.forkserver", "dashboard-modules"),
    ("multiprocessing.resource_tracker", "resource-tracker"),
    ("dashboard/dashboard.py", "dashboard"),
    ("dashboard/agent.py", "dashboard-agent"),
    ("runtime_env/agent/main.py", "runtime-env-agent"),
    ("log_monitor.py", "log-monitor"),
    ("autoscaler/_private/monitor.py", "autoscaler-monitor"),
    ("redis-server", "redis"),
    ("haproxy", "haproxy"),
)


def role_of(cmdline: Sequence[str], name: str = "") -> str:
    """A process's role from its command line (Ray names its workers ``ray::<actor>``)."""
    head = cmdline[0] if cmdline else name
    if m := _REPLICA.match(head):
        return f"{m.group(1)}:{m.group(2)}"
    if m := _ACTOR.match(head):
        return _ACTOR_ROLES.get(m.group(1), m.group(1).lower())
    # Ray's binaries first: the raylet's arguments name the scripts of the agents it starts.
    binary = head.rsplit("/", 1)[-1]
    if binary in _BINARY_ROLES:
        return _BINARY_ROLES[binary]
    joined = " ".join(cmdline) or name
    for needle, role in _SCRIPT_ROLES:
        if needle in joined:
            return role
    return "other"
