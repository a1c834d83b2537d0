# shellcheck shell=bash
# Shared by the cluster drills (pod-kill.sh, node-preemption.sh); sourced, not run.
#
# Settings (environment; defaults in brackets):
#   NAMESPACE           Forge's namespace [forge]
#   SERVE_URL           the Serve entry point, as the load Job sees it [http://forge-serve:8000]
#   GPU_POD_SELECTOR    the GPU worker pods [ray.io/node-type=worker,ray.io/group=gpu-t4]
#   DRILL_DURATION_S    how long the load runs [900]; the GPU's way back takes 5-15 min
#   EVENT_AFTER_S       load before the event, the "before" row [120]
#   DRILL_CONCURRENCY   closed-loop streams [8]     DRILL_MODEL  [qwen2.5-3b-instruct]
#   DRILL_IMAGE         the load Job's image [the gateway image cluster/forge/eval-gate.yaml names]
#   DRILL_OUT           where the Job's log is kept [/tmp]
# Needs kubectl (pointed at the cluster) and python3; node-preemption.sh needs gcloud too. The
# Secret forge-eval-keys (key: `key`, a tenant key) must exist: cluster/README.md.

DRILLS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$DRILLS_DIR/../.." && pwd)"
NAMESPACE="${NAMESPACE:-forge}"
SERVE_URL="${SERVE_URL:-http://forge-serve:8000}"
GPU_POD_SELECTOR="${GPU_POD_SELECTOR:-ray.io/node-type=worker,ray.io/group=gpu-t4}"
DRILL_DURATION_S="${DRILL_DURATION_S:-900}"
EVENT_AFTER_S="${EVENT_AFTER_S:-120}"
DRILL_CONCURRENCY="${DRILL_CONCURRENCY:-8}"
DRILL_MODEL="${DRILL_MODEL:-qwen2.5-3b-instruct}"
DRILL_OUT="${DRILL_OUT:-/tmp}"
JOB=forge-drill-load

log() { printf '%s drill: %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
die() { log "$*"; exit 1; }
now() { python3 -c 'import time; print(f"{time.time():.3f}")'; }

need() {
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || die "needs $tool on PATH"
  done
}

drill_image() {
  if [ -n "${DRILL_IMAGE:-}" ]; then
    echo "$DRILL_IMAGE"
    return
  fi
  sed -n -E 's/^[[:space:]]*image: ([^[:space:]]+)[[:space:]]+# forge-image-tag$/\1/p' \
    "$REPO_ROOT/cluster/forge/eval-gate.yaml" | head -n 1
}

# A running GPU worker pod, or fail: the group scales to zero, so a drill needs traffic first.
gpu_pod() {
  local pod
  pod=$(kubectl get pods -n "$NAMESPACE" -l "$GPU_POD_SELECTOR" \
    --field-selector=status.phase=Running -o jsonpath='{.items[0].metadata.name}')
  [ -n "$pod" ] || die "no running GPU worker pod ($GPU_POD_SELECTOR in $NAMESPACE): the pool is at zero; send traffic until one is up"
  echo "$pod"
}

start_load() {
  local image
  image=$(drill_image)
  [ -n "$image" ] || die "no image for the load Job (set DRILL_IMAGE)"
  log "load: $DRILL_CONCURRENCY streams for ${DRILL_DURATION_S}s against $SERVE_URL ($image)"
  kubectl delete job -n "$NAMESPACE" "$JOB" --ignore-not-found --wait=true >/dev/null
  kubectl create configmap -n "$NAMESPACE" "$JOB" --dry-run=client -o yaml \
    --from-file=drill_load.py="$DRILLS_DIR/drill_load.py" \
    --from-literal=base-url="$SERVE_URL" \
    --from-literal=duration-s="$DRILL_DURATION_S" \
    --from-literal=concurrency="$DRILL_CONCURRENCY" \
    --from-literal=model="$DRILL_MODEL" | kubectl apply -f - >/dev/null
  sed -E "s#^([[:space:]]*image: )[^[:space:]]+([[:space:]]+\# drill-image)\$#\1${image}\2#" \
    "$DRILLS_DIR/load-job.yaml" | kubectl apply -n "$NAMESPACE" -f - >/dev/null
  # Stop the load with the drill (Ctrl-C), rather than leave it running for minutes.
  trap 'kubectl delete job -n "$NAMESPACE" "$JOB" --ignore-not-found --wait=false >/dev/null; exit 130' INT TERM
  # `kubectl wait` on a selector fails while nothing matches: first wait for the pod to exist.
  for _ in $(seq 60); do
    [ -n "$(kubectl get pods -n "$NAMESPACE" -l "job-name=$JOB" -o name)" ] && break
    sleep 2
  done
  kubectl wait -n "$NAMESPACE" --for=condition=Ready pod -l "job-name=$JOB" --timeout=300s >/dev/null \
    || die "the load Job's pod is not Ready after 300 s: kubectl describe job -n $NAMESPACE $JOB"
}

# The GPU worker pods that exist now (names, space-separated): recovery is a pod not among them.
gpu_pods_now() {
  kubectl get pods -n "$NAMESPACE" -l "$GPU_POD_SELECTOR" -o jsonpath='{.items[*].metadata.name}'
}

# In the background: when is a new GPU worker (not one of $1, the pods before the event) up, its
# Ray container running? Not its Ready condition: the chart keeps the T4 pods never Ready, so
# they are never endpoints of the Serve Service (helm/forge: workers.gpu.serveEndpoint). The
# replica's model load comes after; the table's served_by_fallback rows show when traffic is
# home. Writes the answer to $RECOVERY_FILE; finish prints it.
watch_recovery() {
  local before="$1" since="$2"
  RECOVERY_FILE=$(mktemp)
  (
    while true; do
      ready=$(kubectl get pods -n "$NAMESPACE" -l "$GPU_POD_SELECTOR" -o \
        jsonpath='{range .items[*]}{.metadata.name}{" "}{.status.containerStatuses[0].started}{"\n"}{end}' \
        2>/dev/null | awk -v before=" $before " 'index(before, " " $1 " ") == 0 && tolower($2) == "true" {print $1; exit}')
      if [ -n "$ready" ]; then
        python3 -c "import sys, time; print(f'new GPU worker {sys.argv[1]} Ready for Ray (its Ray container running) {time.time() - float(sys.argv[2]):.0f} s after the event')" \
          "$ready" "$since" >"$RECOVERY_FILE"
        exit 0
      fi
      sleep 5
    done
  ) >/dev/null 2>&1 &
  RECOVERY_PID=$!
}

sleep_until_event() {
  log "warming up for ${EVENT_AFTER_S}s (the table's 'before' row)"
  sleep "$EVENT_AFTER_S"
}

# Wait for the load to end, keep its log, print the table for the event at $2 (epoch seconds).
finish() {
  local title="$1" event_at="$2" deadline status out
  deadline=$(( $(date +%s) + DRILL_DURATION_S + 600 ))
  log "waiting for the load to finish (${DRILL_DURATION_S}s from its start)"
  while true; do
    status=$(kubectl get job -n "$NAMESPACE" "$JOB" -o jsonpath='{.status.succeeded}/{.status.failed}')
    case "$status" in
      1/*) break ;;
      */1) log "the load Job failed: its log follows anyway"; break ;;
    esac
    [ "$(date +%s)" -lt "$deadline" ] || die "the load Job has not finished: kubectl get job -n $NAMESPACE $JOB"
    sleep 10
  done
  out="$DRILL_OUT/forge-drill-$(date -u +%Y%m%dT%H%M%SZ).log"
  kubectl logs -n "$NAMESPACE" "job/$JOB" >"$out"
  log "load log: $out"
  echo
  python3 "$DRILLS_DIR/drill_load.py" report "$out" --event-at "$event_at" --event "$title"
  if [ -n "${RECOVERY_PID:-}" ]; then
    kill "$RECOVERY_PID" 2>/dev/null || true
    echo
    if [ -s "$RECOVERY_FILE" ]; then cat "$RECOVERY_FILE"; else echo "no new GPU worker's Ray container was running by the end of the load"; fi
    rm -f "$RECOVERY_FILE"
  fi
}
