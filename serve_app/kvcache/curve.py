"""ZeroMQ CURVE on the KV-event sockets: who may read a replica's events, whom a router believes.

A replica's PUB (its events) and ROUTER (its snapshots) are CURVE servers; the routers' SUB and
DEALER sockets are CURVE clients. CURVE encrypts every message, and each side proves it holds a
secret key: the server its own (a client names the server's public key and the handshake fails
unless the server holds the matching secret), the client its own, which a ZAP handler on the
replica (``Gatekeeper``) checks against the one public key it admits.

One keypair for the whole Forge cluster, not a server pair and a client pair: Serve places
gateway replicas (clients) and pool replicas (servers) on whichever nodes have room, so every Ray
pod would carry both secrets anyway, and one secret is one thing to mount and rotate. Holding it
is what makes a process one of ours: a peer without it can neither subscribe nor ask for a
snapshot, and a process that takes over a dead replica's port cannot feed the routers.

Where the key comes from (``curve_keys``): the environment variable a pool's config names
(``routing.kv_events.curve_secret_env``; a Kubernetes secret on a cluster); when that is unset, a
keypair made for this Ray cluster and kept in Ray's GCS key-value store (put-if-absent, so every
process of the cluster, on any node, reads the same one), which Ray's token authentication
guards: whoever can read it can already run code in the cluster.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass

import zmq
import zmq.auth.thread

logger = logging.getLogger("ray.serve")

_Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_GCS_NAMESPACE = "forge"
_GCS_KEY = b"kv-events-curve-secret"


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The cluster's keypair, both halves Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never the secret, in a log line or a traceback
        return f"CurveKeys(public={self.public.decode()!r})"

    @classmethod
    def from_secret(cls, secret: str | bytes, source: str = "the secret key") -> CurveKeys:
        """The keypair of a Z85 secret key (what ``zmq.curve_keypair()`` makes); the public key
        follows from it. ``source`` names where it came from in the error, never its value."""
        text = secret.decode() if isinstance(secret, bytes) else secret
        text = text.strip()
        if not _Z85_KEY.match(text):
            raise ValueError(
                f"{source} is not a CURVE secret key (40 Z85 characters, as "
                "`python -c 'import zmq; print(zmq.curve_keypair()[1].decode())'` prints)"
            )
        raw = text.encode()
        return cls(public=zmq.curve_public(raw), secret=raw)

    @classmethod
    def generate(cls) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)


def curve_available() -> bool:
    """Whether this libzmq was built with CURVE (libsodium or its own tweetnacl)."""
    return bool(zmq.has("curve"))


def curve_keys(auth: str, secret_env: str) -> CurveKeys | None:
    """The keys a pool's KV-event sockets use (``routing.kv_events``); None for ``auth: none``
    (plaintext, which ``KvEventPublisher`` allows on loopback only)."""
    if auth == "none":
        logger.warning(
            "KV events: routing.kv_events.auth is none: events and snapshots travel in plaintext "
            "and unauthenticated (allowed on loopback only)"
        )
        return None
    if not curve_available():
        raise RuntimeError(
            "KV events: routing.kv_events.auth is curve, but this pyzmq's libzmq has no CURVE; "
            "install a pyzmq wheel (it bundles libsodium) or set auth: none on a laptop"
        )
    value = os.environ.get(secret_env)
    if value:
        return CurveKeys.from_secret(value, f"${secret_env}")
    return _cluster_keys(secret_env)


@functools.cache
def _cluster_keys(secret_env: str) -> CurveKeys:
    """The Ray cluster's own keypair, made by whichever process asks first (see the module)."""
    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        raise RuntimeError(
            f"KV events: ${secret_env} is unset and this process is not in a Ray cluster, "
            "so there is no CURVE key to use; set it (a Kubernetes secret on a cluster)"
        )
    internal_kv._internal_kv_put(
        _GCS_KEY, CurveKeys.generate().secret, overwrite=False, namespace=_GCS_NAMESPACE
    )
    stored = internal_kv._internal_kv_get(_GCS_KEY, namespace=_GCS_NAMESPACE)
    logger.warning(
        "KV events: $%s is unset; using the CURVE keypair made for this Ray cluster (kept in its "
        "GCS, guarded by Ray's token). On a shared cluster, set it from a secret.",
        secret_env,
    )
    return CurveKeys.from_secret(stored, "the Ray cluster's KV-event key")


def serve_curve(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE server with the cluster's key (before it binds)."""
    sock.curve_server = True
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public


def connect_curve(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` a CURVE client that proves it holds the cluster's key and believes only a
    server that holds it too (before it connects)."""
    sock.curve_serverkey = keys.public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


class Gatekeeper:
    """The ZAP handler of a context: its CURVE servers admit only clients holding ``keys``.

    Without one, libzmq lets any CURVE client in that knows the server's public key. It is
    pyzmq's ``ThreadAuthenticator`` (a thread per context, answering each handshake once), with
    a callback that admits exactly one client key. Start it before the sockets bind.
    """

    def __init__(self, context: zmq.Context, keys: CurveKeys) -> None:
        self._public = keys.public
        self._auth = zmq.auth.thread.ThreadAuthenticator(context, log=logger.getChild("zap"))
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        return client_key == self._public

    def stop(self) -> None:
        self._auth.stop()
