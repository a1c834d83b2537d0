"""``forge``: operator commands.

``forge keys new --tenant NAME`` mints a key for a tenant; ``forge breakers [--app forge]``
shows the circuit breakers of a running Forge (on a machine of its Ray cluster), and
``forge breakers --reset [BACKEND]`` closes one, or all; ``forge usage`` reports tokens and
their cost per tenant and model over HTTP (an admin key in ``FORGE_ADMIN_KEY``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
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


def _breakers(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from serve_app import replica_admin

    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
    try:
        if args.reset is not None:
            replica_admin.reset_breakers(args.app, args.reset or None)
        print(json.dumps(replica_admin.describe_breakers(args.app), indent=1))
    finally:
        ray.shutdown()
    return 0


ADMIN_KEY_ENV = "FORGE_ADMIN_KEY"
_USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens")


def _usage(args: argparse.Namespace) -> int:
    import httpx

    # From the environment only: a key on the command line ends up in shell history.
    key = os.environ.get(ADMIN_KEY_ENV)
    if not key:
        return _fail(f"set {ADMIN_KEY_ENV} to an admin key (configs' admin.key_hashes)")
    params = {"group": "total"}
    for name in ("start", "end", "tenant", "model"):
        if getattr(args, name):
            params[name] = getattr(args, name)
    url = args.url.rstrip("/") + "/admin/usage"
    try:
        response = httpx.get(
            url, params=params, headers={"authorization": f"Bearer {key}"}, timeout=args.timeout
        )
    except httpx.ConnectError as exc:
        return _fail(f"cannot connect to {args.url} ({exc}): is Forge running there?")
    except httpx.HTTPError as exc:
        return _fail(f"{url} failed: {type(exc).__name__}: {exc}")
    if response.status_code != 200:
        message = _error_message(response)
        if response.status_code == 401:
            return _fail(f"the gateway refused the key in {ADMIN_KEY_ENV} (401: {message})")
        if response.status_code == 403:
            return _fail(f"{ADMIN_KEY_ENV} is not an admin key (403: {message})")
        return _fail(f"{url} answered {response.status_code}: {message}")
    report = response.json()
    rows = [_costed(line, report.get("prices", {})) for line in report["data"]]
    if args.json:
        print(json.dumps(_usage_json(report, rows), indent=1))
    elif args.csv:
        _usage_csv(report, rows)
    else:
        _usage_table(report, rows)
    return 0


def _fail(message: str) -> int:
    print(f"forge usage: {message}", file=sys.stderr)
    return 1


def _error_message(response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase


def _costed(line: dict, prices: dict) -> dict:
    """A report line and its cost at the response's prices (None: the model has no price)."""
    price = prices.get(line["model"])
    cost = None
    if price is not None:
        cost = (
            line["prompt_tokens"] / 1e6 * price["prompt_per_million"]
            + line["completion_tokens"] / 1e6 * price["completion_per_million"]
            + line["cached_tokens"] / 1e6 * price["cached_per_million"]
        )
    return {**line, "cost": cost}


def _total(rows: list[dict]) -> dict:
    total = {name: sum(r[name] for r in rows) for name in _USAGE_FIELDS}
    total["cost"] = sum(r["cost"] for r in rows if r["cost"] is not None)
    return total


def _usage_json(report: dict, rows: list[dict]) -> dict:
    return {
        "start": report["start"],
        "end": report["end"],
        "currency": report["currency"],
        "rows": rows,
        "total": _total(rows),
        "unpriced_models": sorted({r["model"] for r in rows if r["cost"] is None}),
    }


def _usage_csv(report: dict, rows: list[dict]) -> None:
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(["start", "end", "tenant", "model", *_USAGE_FIELDS, "cost", "currency"])
    for r in rows:
        cost = "" if r["cost"] is None else f"{r['cost']:.6f}"
        counts = [r[name] for name in _USAGE_FIELDS]
        writer.writerow(
            [
                report["start"],
                report["end"],
                r["tenant"],
                r["model"],
                *counts,
                cost,
                report["currency"],
            ]
        )


def _usage_table(report: dict, rows: list[dict]) -> None:
    currency = report["currency"]
    header = ["tenant", "model", "requests", "prompt", "completion", "cached", f"cost ({currency})"]
    total = _total(rows)

    def cells(r: dict, tenant: str, model: str) -> list[str]:
        cost = "unpriced" if r["cost"] is None else f"{r['cost']:,.4f}"
        return [tenant, model, *(f"{r[name]:,}" for name in _USAGE_FIELDS), cost]

    body = [cells(r, r["tenant"], r["model"]) for r in rows]
    footer = cells(total, "total", "")
    widths = [max(len(row[i]) for row in [header, *body, footer]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        pairs = enumerate(zip(row, widths, strict=True))
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in pairs).rstrip()

    print(f"Usage {report['start']} to {report['end']} (UTC)")
    print(line(header))
    print("  ".join("-" * w for w in widths))
    for row in body:
        print(line(row))
    print("  ".join("-" * w for w in widths))
    print(line(footer))
    unpriced = sorted({r["model"] for r in rows if r["cost"] is None})
    if unpriced:
        print(f"No price configured (metering.prices) for: {', '.join(unpriced)}")


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
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
