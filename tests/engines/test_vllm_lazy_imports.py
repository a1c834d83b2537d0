"""The vLLM engine's modules import without vLLM, even where it is installed: configs validate
and the tests above run in the default environment. A fresh interpreter with ``vllm`` blocked
(a ``None`` in ``sys.modules`` makes every import of it fail) imports all three."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
sys.modules["vllm"] = None
import serve_app.engines.vllm_args
import serve_app.engines.vllm_engine
import serve_app.engines.vllm_kv_relay
"""


def test_the_vllm_modules_import_without_vllm():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60
    )

    assert result.returncode == 0, result.stderr
