"""``forge usage``: the admin usage report, costed at the gateway's prices, for people
(a table) and for finance (``--json``, ``--csv``).

The report comes over HTTP from ``GET /admin/usage`` (summed over the range), with the prices
configured in ``metering.prices``; the admin key is read from ``FORGE_ADMIN_KEY`` only, never
from the command line, which ends up in shell history.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys

from serve_app.adapters import split_adapter_model
from serve_app.metering.ledger import ERROR_CLASSES

ADMIN_KEY_ENV = "FORGE_ADMIN_KEY"
# ``requests`` counts every request, refused and failed ones too; ``error_requests`` how many
# of them ended in an error (``/admin/usage``'s ``errors``, by class, summed).
_USAGE_FIELDS = (
    "requests",
    "error_requests",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
)


def run(args: argparse.Namespace) -> int:
    """``forge usage``: fetch ``/admin/usage`` and print it as a table, JSON or CSV."""
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
    """A report line and its cost at the response's prices (None: the model has no price, and
    the line has tokens).
    An adapter's line (``<model>:<adapter>``) takes the adapter's own price, else its model's."""
    base, adapter = split_adapter_model(line["model"])
    price = prices.get(line["model"])
    if price is None and adapter is not None:
        price = prices.get(base)
    tokens = line["prompt_tokens"] + line["completion_tokens"] + line["cached_tokens"]
    cost = 0.0 if tokens == 0 else None  # refused requests only (model "none"): nothing to price
    if price is not None:
        cost = (
            line["prompt_tokens"] / 1e6 * price["prompt_per_million"]
            + line["completion_tokens"] / 1e6 * price["completion_per_million"]
            + line["cached_tokens"] / 1e6 * price["cached_per_million"]
        )
    errors = line.get("errors") or {}
    return {**line, "error_requests": sum(errors.values()), "adapter": adapter, "cost": cost}


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
    by_class = [f"errors_{c}" for c in ERROR_CLASSES]
    writer.writerow(
        ["start", "end", "tenant", "model", *_USAGE_FIELDS, "cost", "currency", *by_class]
    )
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
                *(r["errors"].get(c, 0) for c in ERROR_CLASSES),
            ]
        )


def _usage_table(report: dict, rows: list[dict]) -> None:
    currency = report["currency"]
    header = [
        *("tenant", "model", "requests", "errors", "prompt", "completion", "cached"),
        f"cost ({currency})",
    ]
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
