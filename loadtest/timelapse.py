"""A run's timelapse as one PNG: who served each second, what failed, how slow it was.

    python -m loadtest.timelapse loadtest/results/demo.jsonl docs/img/demo.png \\
        [--events loadtest/results/demo.json]

Every request is binned by the second it was *sent*, so a fault band lines up with the requests
it hit rather than with when they happened to end. Optional events: fault windows (grey band)
and samples of the primary's breaker state (red band while it was not closed).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from loadtest.http_load import _pct
from loadtest.traffic import DROPPED, Result, read_jsonl

# Stacking order and colours: the primary pool(s) at the bottom, then fallback, cache, refused.
_COLOURS = {"fallback": "#f0a030", "cache": "#4caf50", "none": "#b0b0b0"}
_PRIMARY_COLOURS = ("#2b7bba", "#6baed6", "#08519c", "#9ecae1")


def breaker_bands(samples: Sequence[tuple[float, str]], end: float) -> list[tuple[float, float]]:
    """Intervals where the sampled state was not closed (open or half-open), each lasting until
    the next sample that says closed (or the end of the run)."""
    bands: list[tuple[float, float]] = []
    began: float | None = None
    for t, state in sorted(samples):
        if state != "closed" and began is None:
            began = t
        elif state == "closed" and began is not None:
            bands.append((began, t))
            began = None
    if began is not None:
        bands.append((began, end))
    return bands


def _order(backends: set[str]) -> list[str]:
    primaries = sorted(b for b in backends if b not in _COLOURS)
    return primaries + [b for b in _COLOURS if b in backends]


def render(
    results: Sequence[Result],
    path: Path,
    *,
    title: str = "",
    faults: Sequence[tuple[float, float]] = (),
    breaker: Sequence[tuple[float, str]] = (),
    note: str | None = None,
    bin_s: float = 1.0,
) -> None:
    from loadtest.plots import save, subplots

    end = max((r.start for r in results), default=0.0)
    bins = int(end // bin_s) + 1
    xs = [i * bin_s for i in range(bins)]
    per_backend: dict[str, list[float]] = {}
    failed, count, dropped = [0] * bins, [0] * bins, [0] * bins
    ttfts: list[list[float]] = [[] for _ in range(bins)]
    totals: list[list[float]] = [[] for _ in range(bins)]
    for r in results:
        i = int(r.start // bin_s)
        if r.error == DROPPED:
            dropped[i] += 1
            continue
        count[i] += 1
        backend = r.backend or "none"
        per_backend.setdefault(backend, [0.0] * bins)[i] += 1 / bin_s
        if r.status != 200 or r.truncated:
            failed[i] += 1
        else:
            totals[i].append(r.total)
            if r.ttft is not None:
                ttfts[i].append(r.ttft)

    fig, (ax1, ax2, ax3) = subplots(3, 1, figsize=(10, 8), sharex=True)
    bottom = [0.0] * bins
    primary_colours = iter(_PRIMARY_COLOURS)
    for backend in _order(set(per_backend)):
        colour = _COLOURS.get(backend) or next(primary_colours, None)
        label = "no backend (refused)" if backend == "none" else backend
        ax1.bar(xs, per_backend[backend], width=bin_s, bottom=bottom, align="edge",
                label=label, color=colour)  # fmt: skip
        bottom = [b + v for b, v in zip(bottom, per_backend[backend], strict=True)]
    ax1.set_ylabel("requests / s (by send time)")
    ax1.legend(loc="upper right", fontsize=8)

    ratio = [f / c if c else 0.0 for f, c in zip(failed, count, strict=True)]
    ax2.step(xs, ratio, where="post", color="#c0392b", label="failed (non-200 + truncated)")
    if any(dropped):
        ax2b = ax2.twinx()
        ax2b.bar(xs, dropped, width=bin_s, align="edge", color="#555555", alpha=0.4)
        ax2b.set_ylabel("dropped (client)")
    ax2.set_ylim(0, max(0.05, max(ratio, default=0.0) * 1.1))
    ax2.set_ylabel("failed / sent")
    ax2.legend(loc="upper right", fontsize=8)

    def series(values: list[list[float]], p: float) -> list[float]:
        return [_pct(sorted(v), p) * 1000 if v else float("nan") for v in values]

    ax3.plot(xs, series(ttfts, 50), label="TTFT p50", color="#2b7bba")
    ax3.plot(xs, series(ttfts, 95), label="TTFT p95", color="#6baed6", linestyle="--")
    ax3.plot(xs, series(totals, 95), label="total p95", color="#333333")
    ax3.set_ylabel("ms")
    ax3.set_xlabel("seconds into the run")
    ax3.legend(loc="upper right", fontsize=8)

    for ax in (ax1, ax2, ax3):
        for i, (on, off) in enumerate(faults):
            ax.axvspan(on, off, color="grey", alpha=0.18, label="fault on" if i == 0 else None)
        for on, off in breaker_bands(breaker, end + bin_s):
            ax.axvspan(on, off, color="#c0392b", alpha=0.10)
    if breaker:
        ax1.plot(
            [], [], color="#c0392b", alpha=0.3, linewidth=8, label="primary breaker not closed"
        )
        ax1.legend(loc="upper right", fontsize=8)
    if note:
        ax1.text(0.01, 0.97, note, transform=ax1.transAxes, fontsize=8, va="top")
    if title:
        ax1.set_title(title)
    save(fig, Path(path))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="JSON lines from loadtest.traffic")
    parser.add_argument("png", type=Path)
    parser.add_argument("--events", type=Path, help='JSON with "faults" and "breaker" lists')
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    data = json.loads(args.events.read_text()) if args.events else {}
    events = data.get("events", data)  # demo.json keeps them under "events"
    render(
        read_jsonl(args.results),
        args.png,
        title=args.title,
        faults=[tuple(f) for f in events.get("faults", [])],
        breaker=[(s["t"], s["state"]) for s in events.get("breaker", [])],
    )
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
