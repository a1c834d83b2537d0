"""forge-haproxy keeps the listeners Ray renders without a host on loopback."""

from __future__ import annotations

import inspect

from ray.serve._private import haproxy_templates

from serve_app.tools.haproxy_loopback import _config_path, on_loopback

# The lines of Ray 2.60's template this rewrites, as Ray renders them.
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


def test_hostless_binds_move_to_loopback_and_the_admin_socket_is_owner_only():
    rewritten = on_loopback(RENDERED)
    binds = [line.split()[1] for line in rewritten.splitlines() if line.strip().startswith("bind")]
    assert binds == ["127.0.0.1:9101", "127.0.0.1:8000", "127.0.0.1:8404"]
    assert "mode 600 level admin" in rewritten
    assert on_loopback(rewritten) == rewritten  # a reload rewrites an already rewritten file


def test_the_template_still_renders_those_binds_without_a_host():
    """If Ray changes its template, this says so before a laptop listens on every interface."""
    source = inspect.getsource(haproxy_templates)
    assert "bind *:{{ config.stats_port }}" in source
    assert "bind :{{ config.metrics_port }}" in source
    assert "mode 666 level admin" in source


def test_the_config_is_the_argument_after_dash_f():
    assert _config_path(["-db", "-f", "/tmp/cfg", "-sf", "12"]) == "/tmp/cfg"
    assert _config_path(["-v"]) is None
