import os

# Ray must keep its traffic on loopback on these machines; set before Ray is imported anywhere.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The mode configs/local.yaml runs in (gRPC between deployments, direct ingress); see
# docs/benchmarks.md. RAY_SERVE_THROUGHPUT_OPTIMIZED=0 runs the suite on Serve's defaults.
os.environ.setdefault("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
