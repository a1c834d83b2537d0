"""``forge``: operator commands.

``forge keys new --tenant NAME`` mints a key for a tenant; ``forge breakers [--app forge]``
shows the circuit breakers of a running Forge (on a machine of its Ray cluster), and
``forge breakers --reset [BACKEND]`` closes one, or all; ``forge usage`` reports tokens and
their cost per tenant and model over HTTP (an admin key in ``FORGE_ADMIN_KEY``); ``forge config
check FILE`` validates a Serve config file's Forge application (its args and its gateway's live
``user_config``) with the models the gateway uses, before ``serve deploy``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys


def _keys_new(args: argparse.Namespace) -> int:
    from serve_app.auth.keys import hash_key, new_key
    from serve_app.config.base import NAME

    if not re.fullmatch(NAME, args.tenant):  # the line printed must be one the config takes
        print(f"forge keys new: {args.tenant!r} is not a tenant name ({NAME})", file=sys.stderr)
        return 2
    key = new_key()
    digest = hash_key(key)
    print(f"API key for tenant {args.tenant} (shown once, store it now):\n  {key}\n")
    print("Add its hash to the tenant in your Forge config:")
    print(f"  - name: {args.tenant}\n    key_hashes: [{digest}]")
    print("or to the mounted key file (key_hashes_file: {tenant: [sha256, ...]}):")
    print(f"  {args.tenant}: [{digest}]")
    print("or, for an operator's key, to admin.key_hashes (or its file: [sha256, ...]):")
    print(f"  - {digest}")
    return 0


def _keys_hash(args: argparse.Namespace) -> int:
    from serve_app.auth.keys import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        print("forge keys hash: read no key on standard input", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def _breakers(args: argparse.Namespace) -> int:
    # Read when Ray's constants are first imported, so set before anything imports Ray (nothing
    # at this module's top does): loopback, as the cluster itself runs here.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if not _answers(args.address):  # Ray's own connect retries for minutes
        print(f"forge breakers: no Ray cluster answers at {args.address}", file=sys.stderr)
        return 2
    import ray

    from serve_app.replica import admin as replica_admin

    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    try:
        if args.reset is not None:
            replica_admin.reset_breakers(args.app, args.reset or None)
        print(json.dumps(replica_admin.describe_breakers(args.app), indent=1))
    finally:
        ray.shutdown()
    return 0


def _answers(address: str) -> bool:
    """Whether a GCS address written ``host:port`` takes a connection (``auto`` and URLs are
    Ray's to find)."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not port.isdigit():
        return True
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError:
        return False
    return True


def _config_check(args: argparse.Namespace) -> int:
    import yaml

    from serve_app.config.live import (
        GATEWAY_DEPLOYMENT,
        gateway_user_config,
        live_digest,
        serve_config_forge,
    )
    from serve_app.config.models import ConfigError
    from serve_app.config.serve_file import serve_file_problems

    try:
        with open(args.file) as f:
            document = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as err:
        print(f"forge config check: {err}", file=sys.stderr)
        return 2
    shape = serve_file_problems(document)
    if shape:
        print(f"invalid Serve config {args.file}:\n" + "\n".join(shape), file=sys.stderr)
        return 1
    apps = [a for a in document["applications"] if a.get("name") == args.app]
    if not apps:
        print(f"forge config check: no application named {args.app!r}", file=sys.stderr)
        return 2
    try:
        config = serve_config_forge(document, args.app)  # and each pool's own application
        mounted = _key_files_read(config)  # as the gateway reads them, where they are here
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 1
    except (ValueError, OSError, yaml.YAMLError) as err:
        print(f"invalid key file: {err}", file=sys.stderr)
        return 1
    if not config.tenants:
        # What the gateway's start-up refuses (``GatewayIngress.check_health``).
        where = "its gateway deployment's user_config"
        if gateway_user_config(apps[0]) is None:
            where = f"a deployment named {GATEWAY_DEPLOYMENT!r} with a user_config (none here)"
        print(
            f"no tenants: the gateway would not start; list them in {where} or in the "
            "application's args",
            file=sys.stderr,
        )
        return 1
    tenants = ", ".join(t.name for t in config.tenants)
    apart = [p["app"] for p in apps[0].get("args", {}).get("pools", []) if p.get("app")]
    control = apps[0].get("args", {}).get("control_app")
    print(
        f"ok: {len(config.tenants)} tenant(s) ({tenants}), {len(config.pools)} pool(s)"
        + (f" ({len(apart)} in applications of their own: {', '.join(apart)})" if apart else "")
        + (f"; schedulers and breaker board in {control}" if control else "")
        + f"; live configuration {live_digest(config)}"
        + "".join(f"; {line}" for line in mounted)
    )
    for name in sorted(set(config.metering.prices) - _served_names(config)):
        # Not an error: a model retired from the pools still has usage to price.
        print(f"note: metering.prices.{name}: no pool, adapter or fallback serves {name!r} now")
    return 0


def _served_names(config) -> set[str]:
    """The names the ledger records usage under: what served it."""
    names = {p.model for p in config.pools}
    names |= {f"{p.model}:{a.name}" for p in config.pools for a in p.adapters}
    if config.fallback is not None:
        names.add(config.fallback.model)
    return names


def _key_files_read(config) -> list[str]:
    """The mounted key files the config names, read and checked as a gateway reads them
    (``KeyRing``, ``AdminKeys``) where they exist on this machine; said where they do not."""
    import os

    from serve_app.auth.keys import AdminKeys, KeyRing

    said = []
    for field, path in (
        ("key_hashes_file", config.key_hashes_file),
        ("admin.key_hashes_file", config.admin.key_hashes_file),
    ):
        if path and not os.path.exists(path):
            said.append(f"{field} {path} not on this machine: not checked")
    if config.key_hashes_file and os.path.exists(config.key_hashes_file):
        KeyRing.from_config(config)
        said.append(f"{config.key_hashes_file} read")
    if config.admin.key_hashes_file and os.path.exists(config.admin.key_hashes_file):
        AdminKeys.from_config(config)
        said.append(f"{config.admin.key_hashes_file} read")
    return said


def _usage(args: argparse.Namespace) -> int:
    from serve_app.admin import usage_report

    return usage_report.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forge", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    keys = commands.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True)
    new = keys.add_parser("new", help="mint a key and print the config line for its hash")
    new.add_argument("--tenant", required=True)
    new.set_defaults(run=_keys_new)
    hashed = keys.add_parser("hash", help="print the SHA-256 of a key read from stdin")
    hashed.set_defaults(run=_keys_hash)
    breakers = commands.add_parser("breakers", help="show (or reset) the circuit breakers")
    breakers.add_argument("--app", default="forge", help="the Serve application's name")
    breakers.add_argument("--address", default="auto", help="the Ray cluster to connect to")
    breakers.add_argument(
        "--reset",
        nargs="?",
        const="",
        metavar="BACKEND",
        help="close this backend's breaker (primary, primary/<replica>, fallback), or all",
    )
    breakers.set_defaults(run=_breakers)
    config = commands.add_parser("config", help="the Forge configuration").add_subparsers(
        dest="action", required=True
    )
    check = config.add_parser(
        "check",
        help="validate a Serve config file's Forge app (args and live user_config)",
        description="Exit 1 with each bad field's path, as the gateway would refuse it.",
    )
    check.add_argument("file", help="a Ray Serve config file (configs/local.yaml)")
    check.add_argument("--app", default="forge", help="the Serve application's name")
    check.set_defaults(run=_config_check)
    usage = commands.add_parser(
        "usage",
        help="tokens and cost per tenant and model (admin key in $FORGE_ADMIN_KEY)",
        description="Usage per tenant and model over a range of UTC days, costed at the "
        "gateway's configured prices. The admin key is read from $FORGE_ADMIN_KEY only.",
    )
    usage.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's address")
    usage.add_argument("--start", metavar="YYYY-MM-DD", help="first day (default: today, UTC)")
    usage.add_argument("--end", metavar="YYYY-MM-DD", help="last day (default: today, UTC)")
    usage.add_argument("--tenant", help="only this tenant")
    usage.add_argument("--model", help="only this served model")
    usage.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    form = usage.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="JSON, with a total")
    form.add_argument("--csv", action="store_true", help="CSV: a header, one row per tenant×model")
    usage.set_defaults(run=_usage)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:  # `forge usage --json | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 1


if __name__ == "__main__":
    sys.exit(main())
