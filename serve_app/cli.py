"""``forge``: operator commands. ``forge keys new --tenant NAME`` mints a key for a tenant."""

from __future__ import annotations

import argparse
import sys

from serve_app.auth import hash_key, new_key


def _keys_new(args: argparse.Namespace) -> int:
    key = new_key()
    digest = hash_key(key)
    print(f"API key for tenant {args.tenant} (shown once, store it now):\n  {key}\n")
    print("Add its hash to the tenant in your Forge config:")
    print(f"  - name: {args.tenant}\n    key_hashes: [{digest}]")
    return 0


def _keys_hash(args: argparse.Namespace) -> int:
    key = sys.stdin.readline().strip()
    if not key:
        print("forge keys hash: read no key on standard input", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forge", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    keys = commands.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True)
    new = keys.add_parser("new", help="mint a key and print the config line for its hash")
    new.add_argument("--tenant", required=True)
    new.set_defaults(run=_keys_new)
    hashed = keys.add_parser("hash", help="print the SHA-256 of a key read from stdin")
    hashed.set_defaults(run=_keys_hash)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
