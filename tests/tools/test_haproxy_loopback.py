"""forge-haproxy: Serve's control headers never reach Serve from a client, the operator's routes
are not on the clients' front when an admin port is set, and HAProxy's side listeners are no
wider than its front.

The rules are checked on the config Ray 2.60's own renderer writes (``forge_haproxy.py``), by
HAProxy itself (``haproxy -c``), and by running it, through ``forge-haproxy``, in front of a
server that answers with the headers it got.
"""

from __future__ import annotations

import http.client
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from ray.serve._private import constants as serve_constants
from ray.serve._private import haproxy_templates

from serve_app.stages import request_id
from serve_app.tools import haproxy_loopback
from serve_app.tools.haproxy_loopback import (
    ADMIN_PORT_SETTING,
    MARK,
    _config_path,
    admin_listener,
    closed_to_clients,
    on_loopback,
    rewrite,
)
from tests.tools import forge_haproxy

# The lines of Ray 2.60's template the loopback rewrite touches, as Ray renders them.
RENDERED = """\
global
    stats socket /tmp/haproxy-serve/n1/admin.sock mode 666 level admin expose-fd listeners
frontend prometheus
    bind :9101
frontend http_frontend
    bind 127.0.0.1:8000
listen stats
  bind *:8404
"""


def _binds(config: str) -> list[str]:
    return [line.split()[1] for line in config.splitlines() if line.strip().startswith("bind")]


def _serve_config(tmp_path: Path, front_host: str) -> str:
    return forge_haproxy.render_serve_config(
        tmp_path,
        front_host=front_host,
        front_port=8000,
        servers=[("127.0.0.1", 30000)],
        stats_port=8404,
        metrics_port=9101,
    ).read_text()


# -- listeners --------------------------------------------------------------------------------


def test_with_the_front_on_loopback_every_listener_is_and_the_admin_socket_is_owner_only():
    rewritten = on_loopback(RENDERED)
    assert _binds(rewritten) == ["127.0.0.1:9101", "127.0.0.1:8000", "127.0.0.1:8404"]
    assert "mode 600 level admin" in rewritten
    assert on_loopback(rewritten) == rewritten  # a reload rewrites an already rewritten file


def test_with_the_front_on_every_interface_the_listeners_stay_where_ray_put_them(tmp_path):
    """A pod (``http_options.host: 0.0.0.0``, rendered ``bind *:8000``): Prometheus scrapes
    9101 from another namespace; the NetworkPolicy keeps all three in."""
    config = _serve_config(tmp_path, "0.0.0.0")
    rewritten = rewrite(config)
    assert _binds(rewritten) == _binds(config) == [":9101", "*:8000", "*:8404"]
    assert "mode 600 level admin" in rewritten


def test_the_template_still_renders_those_binds_without_a_host():
    """If Ray changes its template, this says so before a laptop listens on every interface."""
    source = inspect.getsource(haproxy_templates)
    assert "bind *:{{ config.stats_port }}" in source
    assert "bind :{{ config.metrics_port }}" in source
    assert "mode 666 level admin" in source


def test_the_config_is_the_argument_after_dash_f():
    assert _config_path(["-db", "-f", "/tmp/cfg", "-sf", "12"]) == "/tmp/cfg"
    assert _config_path(["-v"]) is None


# -- the rules in Serve's config --------------------------------------------------------------


def _frontend(config: str) -> list[str]:
    lines = config.splitlines()
    start = lines.index("frontend http_frontend")
    end = next(
        i for i in range(start + 1, len(lines)) if not lines[i].startswith((" ", "\t")) and lines[i]
    )
    return [line.strip() for line in lines[start + 1 : end]]


@pytest.mark.parametrize("front_host", ["127.0.0.1", "0.0.0.0"])
def test_the_rules_come_first_in_the_clients_frontend_of_serves_own_config(tmp_path, front_host):
    rewritten = rewrite(_serve_config(tmp_path, front_host))
    frontend = _frontend(rewritten)
    rules = [line for line in frontend if line.startswith("http-request")]
    ours = haproxy_loopback.control_header_rules({})
    assert rules[: len(ours)] == ours  # before Serve's own, which read x-request-id
    assert frontend.index(MARK) == 1  # right after the bind line
    assert rewritten.count(MARK) == 1 and rewrite(rewritten) == rewritten


@pytest.mark.parametrize("admin_port", [None, 8001], ids=["one-front", "admin-port"])
@pytest.mark.parametrize("front_host", ["127.0.0.1", "0.0.0.0"])
def test_haproxy_accepts_the_rewritten_config(tmp_path, front_host, admin_port):
    path = tmp_path / "rewritten.cfg"
    environ = {ADMIN_PORT_SETTING: str(admin_port)} if admin_port else {}
    path.write_text(rewrite(_serve_config(tmp_path, front_host), environ))
    checked = subprocess.run(
        [haproxy_loopback._real_haproxy(), "-c", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ALERT" not in checked.stdout + checked.stderr


# -- the admin listener -------------------------------------------------------------------


def test_an_admin_port_is_a_second_frontend_beside_the_clients(tmp_path):
    config = _serve_config(tmp_path, "0.0.0.0")
    rewritten = rewrite(config, {ADMIN_PORT_SETTING: "8001"})
    assert _binds(rewritten) == [":9101", "*:8000", "*:8001", "*:8404"]
    assert rewrite(rewritten, {ADMIN_PORT_SETTING: "8001"}) == rewritten  # a reload
    # The copy keeps Serve's routes and the header rules; the clients' front gains the path rule.
    operator = rewritten.split("frontend forge_admin\n", 1)[1].split("\nbackend ", 1)[0]
    assert MARK in operator and "use_backend forge if is_forge" in operator
    assert "return status 404" not in operator
    assert "unless { path_beg /v1/ }" in "\n".join(_frontend(rewritten))
    assert _binds(rewrite(config, {})) == [":9101", "*:8000", "*:8404"]  # unset: one front


@pytest.mark.parametrize("value", ["http", "0", "70000", "8000"])
def test_an_admin_port_that_is_no_port_or_the_clients_is_refused(tmp_path, value):
    config = _serve_config(tmp_path, "0.0.0.0")
    with pytest.raises(ValueError, match=ADMIN_PORT_SETTING):
        admin_listener(config, {ADMIN_PORT_SETTING: value})


def test_a_config_without_the_clients_frontend_is_refused_not_started_open():
    with pytest.raises(ValueError, match="http_frontend"):
        closed_to_clients("global\nfrontend prometheus\n    bind :9101\n")
    with pytest.raises(ValueError, match="bind"):
        closed_to_clients("frontend http_frontend\n    mode http\nfrontend x\n    bind :1\n")


def test_the_program_exits_without_running_haproxy_on_such_a_config(tmp_path):
    path = tmp_path / "haproxy.cfg"
    path.write_text("global\n")
    ran = subprocess.run(
        [sys.executable, "-m", forge_haproxy.PROGRAM, "-db", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ran.returncode != 0 and "not starting HAProxy" in ran.stderr
    assert path.read_text() == "global\n"


# -- the names, as Ray and Forge spell them ---------------------------------------------------


def test_the_headers_are_the_ones_serve_reads():
    assert set(haproxy_loopback.SERVE_OWN_HEADERS) == {
        serve_constants.SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER,
        serve_constants.SERVE_HTTP_REQUEST_DISCONNECT_DISABLED_HEADER,
    }
    assert haproxy_loopback.SERVE_ROUTING_HEADERS == (serve_constants.SERVE_MULTIPLEXED_MODEL_ID,)
    setting, default = haproxy_loopback.SESSION_HEADER_SETTING
    assert serve_constants.SERVE_SESSION_ID == os.environ.get(setting, default)
    assert serve_constants.SERVE_HTTP_REQUEST_ID_HEADER == request_id.HEADER == "x-request-id"


def test_haproxy_keeps_every_id_forge_keeps_and_no_other():
    assert haproxy_loopback.REQUEST_ID_SHAPE == request_id._ACCEPTABLE.pattern


def test_the_session_header_follows_rays_setting():
    rules = haproxy_loopback.control_header_rules({"RAY_SERVE_SESSION_ID_HEADER_KEY": "X-Sticky"})
    assert "http-request del-header '^x[-_]sticky$' -m reg" in rules


# -- what arrives behind it -------------------------------------------------------------------


class _Echo(BaseHTTPRequestHandler):
    """Answers with the request's headers, as (name, value) pairs (values as latin-1)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = json.dumps(self.headers.items()).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def front(tmp_path_factory) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        directory = tmp_path_factory.mktemp("forge-haproxy")
        with forge_haproxy.running(directory, [server.server_address]) as url:
            yield url
    finally:
        server.shutdown()
        server.server_close()


def arrived(front: str, *headers: bytes) -> list[tuple[str, str]]:
    """The headers (but Host) that reach the server behind ``front`` for a request with these
    raw header lines."""
    port = int(front.rsplit(":", 1)[1])
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(h + b"\r\n" for h in headers)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + b"\r\n")
        response = http.client.HTTPResponse(sock)
        response.begin()
        assert response.status == 200, response.read()
        pairs = json.loads(response.read())
    return [(name.lower(), value) for name, value in pairs if name.lower() != "host"]


@pytest.mark.parametrize(
    "raw",
    [
        b"X-Request-Timeout-Seconds: 0.001",
        b"x-request-timeout-seconds: 0",
        b"X-Request-Timeout-Seconds: \xff",
        b"X-Request-Disconnect-Disabled: ?1",
        b"serve_multiplexed_model_id: some-model",
        b"Serve-Multiplexed-Model-Id: \xff",
        b"serve-multiplexed_model-id: mixed",
        b"X-Session-Id: \xff",
        b"x_session_id: sticky",
    ],
)
def test_serves_own_headers_never_arrive(front, raw):
    assert arrived(front, raw, b"Authorization: Bearer sk-x") == [("authorization", "Bearer sk-x")]


@pytest.mark.parametrize(
    "raw",
    [
        b"X-Request-Timeout: 0.5",  # Forge's own deadline (serve_app/gateway), not Serve's
        b"X-Request-Timeout-Seconds-Extra: 1",
        b"X-Session-Identity: mine",
        b"X-Forge-Priority: \xe9\x80",  # Forge reads it, and refuses what is not text
        b"Cache-Control: no-cache",
        b"X-Request-Ids: a b",
    ],
)
def test_other_headers_arrive_as_sent(front, raw):
    name, _, value = raw.partition(b": ")
    assert arrived(front, raw) == [(name.decode().lower(), value.decode("latin-1"))]


@pytest.mark.parametrize(
    "value",
    [b"0f3c9a2e", b"req_1.2:3-x", b"ABC-def", b"r" * 128],
    ids=["hex", "punctuation", "case", "128"],
)
def test_a_request_id_forge_keeps_arrives(front, value):
    assert request_id._ACCEPTABLE.fullmatch(value.decode())
    assert arrived(front, b"X-Request-Id: " + value) == [("x-request-id", value.decode())]


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param([b"X-Request-Id: \xff\xfe\x80"], id="not-utf8"),
        pytest.param([b"X-Request-Id: caf\xe9"], id="latin1"),
        pytest.param([b"x-request-id: caf\xc3\xa9"], id="utf8-not-ascii"),
        pytest.param([b"X-Request-Id: " + b"r" * 129], id="129"),
        pytest.param([b"X-Request-Id: " + b"r" * 8000], id="8k"),
        pytest.param([b"X-Request-Id: a b"], id="space"),
        pytest.param([b"X-Request-Id: a,b"], id="comma"),
        pytest.param([b"X-Request-Id: <script>"], id="markup"),
        pytest.param([b"X-Request-Id:"], id="empty"),
        pytest.param([b"X-Request-Id: a", b"X-Request-Id: b"], id="two"),
        pytest.param([b"X-Request-Id: ok", b"X-Request-Id: \xff"], id="two-one-bad"),
    ],
)
def test_any_other_request_id_is_deleted(front, headers):
    assert arrived(front, *headers) == []


# -- the operator's routes, refused on the clients' front ------------------------------------


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> Iterator[tuple[int, int]]:
    """Forge's HAProxy with an admin port, in front of the echo server: (clients', operator's)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    admin_port = forge_haproxy.free_port()
    try:
        directory = tmp_path_factory.mktemp("forge-haproxy-split")
        environ = {ADMIN_PORT_SETTING: str(admin_port)}
        with forge_haproxy.running(directory, [server.server_address], environ=environ) as url:
            yield int(url.rsplit(":", 1)[1]), admin_port
    finally:
        server.shutdown()
        server.server_close()


def answer(port: int, target: bytes, method: bytes = b"GET") -> tuple[int, bytes]:
    """The status and body HAProxy on ``port`` gives for a request line's raw ``target``."""
    head = method + b" " + target + b" HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()


ADMIN_TARGETS = [
    b"/admin/status",
    b"/admin/faults",
    b"/admin/breakers/reset",
    b"/admin/usage?tenant=a",
    b"/docs",
    b"/openapi.json",
    b"/%61dmin/status",  # uvicorn decodes it to /admin/status
    b"//admin/status",
    b"/./admin/status",
    b"http://x/admin/status",  # absolute form
    b"/ADMIN/status",
    b"/v1",
]
# Under /v1/ in any spelling, a path is the API's: the gateway routes "/v1/../admin/status" as
# it is, to its own 404 (tests/e2e/test_hostile.py sends these through to it).


@pytest.mark.parametrize("target", ADMIN_TARGETS)
def test_the_clients_front_refuses_the_operators_routes_in_forges_error_shape(split, target):
    clients, _ = split
    for method in (b"GET", b"POST"):
        status, body = answer(clients, target, method)
        assert status == 404, body
        error = json.loads(body)["error"]
        assert error["code"] == "not_found" and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "target", [b"/v1/models", b"/v1/chat/completions", b"/healthz", b"/readyz", b"/v1/usage"]
)
def test_the_clients_front_passes_the_api(split, target):
    clients, _ = split
    assert answer(clients, target)[0] == 200


@pytest.mark.parametrize("target", [b"/admin/status", b"/docs", b"/openapi.json", b"/v1/models"])
def test_the_admin_port_passes_everything_with_serves_headers_still_deleted(split, target):
    _, operator = split
    assert answer(operator, target)[0] == 200
    assert arrived(f"http://127.0.0.1:{operator}", b"X-Request-Timeout-Seconds: 0") == []
