#!/usr/bin/env bash
# Prometheus on a laptop, scraping a local `serve run` (or any local Ray) through the target list
# Ray writes for it, with Forge's recording and alert rules loaded.
#
#   bash scripts/prometheus-local.sh [PORT]     # PORT defaults to 9090; Ctrl-C stops it
#
# Ray's metrics agent picks a free port at start-up; every Ray head writes the ports it exposes
# metrics on to /tmp/ray/prom_metrics_service_discovery.json (a link to the current session's
# file), which this Prometheus reads as file_sd: start it before or after Ray, and across Ray
# restarts, it follows. It listens on 127.0.0.1 only and keeps its data in a temporary directory,
# removed when it stops. Debian's `prometheus` package is installed if there is none.
set -euo pipefail

port="${1:-9090}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
sd_file="/tmp/ray/prom_metrics_service_discovery.json"

if ! command -v prometheus >/dev/null; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "Installing Debian's prometheus package (no recommends: no node exporter)..." >&2
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  # The package starts a system-wide Prometheus on 0.0.0.0:9090; this script runs its own.
  ($sudo service prometheus stop || $sudo systemctl stop prometheus || true) >/dev/null 2>&1
fi

if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
  echo "Port $port on 127.0.0.1 is taken (a system Prometheus? \`service prometheus stop\`)," \
    "or pass another: bash scripts/prometheus-local.sh 9091" >&2
  exit 1
fi

work="$(mktemp -d -t forge-prometheus.XXXXXX)"
prom_pid=""
cleanup() {
  if [ -n "$prom_pid" ]; then
    kill "$prom_pid" 2>/dev/null || true
    wait "$prom_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

cat >"$work/prometheus.yml" <<EOF
global:
  scrape_interval: 5s
  evaluation_interval: 5s
rule_files:
  - $repo/observability/prometheus/forge-rules.yaml
scrape_configs:
  - job_name: ray
    file_sd_configs:
      - files: [$sd_file]
        refresh_interval: 5s
EOF

prometheus \
  --config.file="$work/prometheus.yml" \
  --storage.tsdb.path="$work/data" \
  --web.listen-address="127.0.0.1:$port" \
  >"$work/prometheus.log" 2>&1 &
prom_pid=$!

for _ in $(seq 100); do
  if ! kill -0 "$prom_pid" 2>/dev/null; then
    echo "Prometheus exited during start-up:" >&2
    tail -n 20 "$work/prometheus.log" >&2
    exit 1
  fi
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  sleep 0.2
done

[ -e "$sd_file" ] || echo "No $sd_file yet: targets appear once Ray starts." >&2
cat <<EOF
Prometheus: http://127.0.0.1:$port  (targets: http://127.0.0.1:$port/targets)
  scraping every 5 s whatever Ray lists in $sd_file
  try: sum(ray_forge_requests_total)   or   sum by (tenant, status) (ray_forge_requests_total)
  its log: $work/prometheus.log; data in $work (removed on exit). Ctrl-C stops it.
EOF
wait "$prom_pid"
