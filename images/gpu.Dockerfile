# syntax=docker/dockerfile:1
# The GPU worker image: Forge with the `vllm` extra (vllm==0.32.0, pyproject.toml) on Ray's CUDA
# image, for the spot T4 worker group (Turing, sm_75: fp16, configs/gke.yaml).
#
#   docker build -f images/gpu.Dockerfile -t forge-ray-vllm .              # from the repository root
#
# Base: Ray's GPU image at the pinned Ray release, Python 3.11 (its default CUDA 12 build). Pinned
# by version; pin the digest too for a reproducible build (placeholder: none resolved offline):
#   docker buildx imagetools inspect rayproject/ray:2.60.0-py311-gpu --format '{{json .Manifest.Digest}}'
#   FROM rayproject/ray:2.60.0-py311-gpu@sha256:<that digest>
FROM rayproject/ray:2.60.0-py311-gpu

# vLLM's CUDA build, and torch's with it: vLLM's default PyPI wheel is CUDA 13.0 (since 0.20),
# which starts only on an R580+ driver; the CUDA 12.9 build runs on any R525+ driver (CUDA's
# minor-version compatibility), which GKE's LATEST driver on the T4 pool is (terraform:
# gpu_driver_version). The pairing and its sources: images/cuda-drivers.yaml, checked by
# tests/deploy/test_terraform.py. The wheels come with their own CUDA runtime (pip's nvidia-*
# packages): the base image's CUDA is not the one that runs.
ARG VLLM_CUDA=cu129

USER 1000
# Made by that user (WORKDIR alone may create it as root): pip builds Forge in place here.
RUN mkdir -p /home/ray/forge
WORKDIR /home/ray/forge

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0

# The same allow-listed context as images/gateway.Dockerfile (see .dockerignore).
COPY --chown=1000:100 . .

# The vllm extra's version is pinned in pyproject.toml (vllm==0.32.0); pip resolves it with Ray
# held at the base image's release, and prefers the +cu129 builds of vLLM and torch from the
# two extra indexes (for this RUN only; a local version label sorts above the plain one). The
# checks run without a GPU (no CUDA call at import): the build fails unless torch is the CUDA
# 12 build.
# DL3013 wants `pkg==version` on the command line: here the package is this checkout and the
# extra's pin lives in pyproject.toml, which hadolint cannot read.
# hadolint ignore=DL3013
RUN PIP_EXTRA_INDEX_URL="https://wheels.vllm.ai/0.32.0/${VLLM_CUDA} https://download.pytorch.org/whl/${VLLM_CUDA}" \
    pip install --no-cache-dir ".[vllm]" \
    && python -c "import serve_app.app, vllm, torch; assert torch.version.cuda.split('.')[0] == '${VLLM_CUDA}'[2:4], torch.version.cuda" \
    && test -x /home/ray/anaconda3/bin/forge-haproxy  # configs/gke.yaml: RAY_SERVE_HAPROXY_BINARY_PATH
