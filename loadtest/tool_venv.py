"""A benchmark's outside tool (LiteLLM's proxy, GuideLLM) in a virtualenv of its own, made once
and reused: such tools are never dependencies of Forge, and their pins would fight Forge's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def python_of(venv: Path) -> Path:
    return Path(venv).expanduser() / "bin" / "python"


def installed_version(venv: Path, dist: str) -> str | None:
    """``dist``'s version in ``venv``, or None where it (or the virtualenv) is missing."""
    python = python_of(venv)
    if not python.exists():
        return None
    probe = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
        capture_output=True,
        text=True,
    )
    return probe.stdout.strip() if probe.returncode == 0 else None


def ensure(venv: Path, dist: str, version: str, requirements: list[str]) -> Path:
    """The virtualenv with ``dist==version`` in it, made or fixed up with ``pip install
    requirements`` if need be."""
    venv = Path(venv).expanduser()
    if installed_version(venv, dist) == version:
        return venv
    if not python_of(venv).exists():
        venv.parent.mkdir(parents=True, exist_ok=True)
        print(f"creating {venv} for {dist}=={version}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(python_of(venv)), "-m", "pip", "install", "-q", *requirements], check=True)
    got = installed_version(venv, dist)
    if got != version:
        raise RuntimeError(f"{venv}: {dist} {got} installed, {version} wanted")
    return venv
