# syntax=docker/dockerfile:1
# The Ray image Forge runs on the cluster: the head and the CPU workers (gateways, scheduler,
# breaker board), and the tools that run beside them (the eval gate Job, the drill load Job).
#
#   docker build -f images/gateway.Dockerfile -t forge-ray .      # from the repository root
#
# Base: Ray's own image at the Ray release pyproject.toml pins (ray[serve]>=2.60,<2.61), Python
# 3.11, CPU only. Pinned by version here; for a reproducible build pin the digest too, which is
# what CI should do once the tag is resolved:
#   docker buildx imagetools inspect rayproject/ray:2.60.0-py311-cpu --format '{{json .Manifest.Digest}}'
#   FROM rayproject/ray:2.60.0-py311-cpu@sha256:<that digest>
# (placeholder: no digest is written here because none could be resolved offline).
FROM rayproject/ray:2.60.0-py311-cpu

# Ray's image runs as `ray` (uid 1000, gid 100) with its Python in /home/ray/anaconda3, owned by
# that user: the install below needs no root at all.
USER 1000
# Made by that user (WORKDIR alone may create it as root): pip builds Forge in place here.
RUN mkdir -p /home/ray/forge
WORKDIR /home/ray/forge

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0

# The build context is allow-listed by .dockerignore (serve_app, configs, loadtest, evals,
# pyproject.toml, README.md): no tests, no .git, no state files, no keys. evals/ and loadtest/ stay
# in the working directory rather than the package (pyproject installs serve_app only), so
# `python -m evals` and `python -m loadtest.http_load` run from here.
COPY --chown=1000:100 . .

# Forge and its runtime dependencies (the eval gate's openai client among them); no dev extra.
# Ray itself is already the base image's, at the version pyproject.toml accepts, so pip keeps it.
# DL3013 wants `pkg==version` on the command line: here the package is this checkout and the
# pins live in pyproject.toml, which hadolint cannot read.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "." \
    && python -c "import serve_app.app, openai" \
    && test -x /home/ray/anaconda3/bin/forge-haproxy  # configs/gke.yaml: RAY_SERVE_HAPROXY_BINARY_PATH

