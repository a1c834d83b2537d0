# Entry points that are more than one command. `make help` lists them.
PYTHON ?= .venv/bin/python
# Ray keeps its traffic on loopback and sends no usage stats (see README).
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER = 0
export RAY_USAGE_STATS_ENABLED = 0

.PHONY: help demo

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-8s %s\n", $$1, $$2}'

# The lock: one `serve run configs/local.yaml` (port 8000) on this machine at a time.
demo: ## start configs/local.yaml, 2 min of multi-tenant load, primary failing 40-80 s (DEMO_ARGS=...)
	@echo "waiting for /tmp/forge-serve.lock (one local graph at a time) ..."
	$(if $(shell command -v flock),flock /tmp/forge-serve.lock) $(PYTHON) -m loadtest.demo $(DEMO_ARGS)
