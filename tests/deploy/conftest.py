"""The deploy artifacts (terraform/, helm/, cluster/, images/, .github/), validated offline.

The validators (Helm's SDK, python-hcl2, checkov, kubernetes-validate, check-jsonschema, zizmor,
hadolint) live in a virtualenv of their own, named by ``FORGE_DEPLOY_TOOLS``: ``.ci/deploy``
builds and caches it, then runs ``pytest -m deploy tests/deploy``. Without it every test here
skips with a reason. Python-level tools (the Helm SDK, hcl2) run as that virtualenv's
``python`` on small scripts, so nothing of theirs is imported into Forge's environment.

Each check is proved by a test that feeds it broken input and sees it fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.deploy)


@dataclass(frozen=True)
class Tools:
    """The validators' virtualenv."""

    venv: Path

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *argv: str, cwd: Path = ROOT, check: bool = False) -> subprocess.CompletedProcess:
        """A tool of the venv (``argv[0]`` is its script name), its output captured."""
        return subprocess.run(
            [self.bin(argv[0]), *argv[1:]],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=check,
            timeout=600,
        )

    def python(self, script: str, *args: str) -> object:
        """Run ``script`` (Python source) in the tools' interpreter; its stdout is JSON."""
        done = subprocess.run(
            [self.bin("python"), "-c", script, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if done.returncode != 0:
            raise ToolFailed(done.stderr.strip() or done.stdout.strip())
        return json.loads(done.stdout)


class ToolFailed(Exception):
    """A tool refused its input; the message is what it said."""


@pytest.fixture(scope="session")
def tools() -> Tools:
    venv = os.environ.get("FORGE_DEPLOY_TOOLS")
    if not venv:
        pytest.skip("FORGE_DEPLOY_TOOLS is not set: .ci/deploy builds the validators, runs these")
    path = Path(venv)
    if not (path / "bin" / "python").exists():
        pytest.fail(f"FORGE_DEPLOY_TOOLS={venv} is not a virtualenv")
    return Tools(path)
