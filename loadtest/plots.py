"""Figures for the drills: headless matplotlib, saved where docs/ links them."""

from __future__ import annotations

from pathlib import Path


def subplots(*args, **kwargs):
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save(fig, path: Path) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
