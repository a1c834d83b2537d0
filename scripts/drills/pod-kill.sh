#!/usr/bin/env bash
# Drill: delete a GPU worker pod under steady in-cluster load, then print requests, served by the
# fallback, 5xx, client-visible errors and p50/p95, before and after the kill and per minute.
#
#   scripts/drills/pod-kill.sh            # a graceful delete (the pod's grace period and preStop)
#   FORCE=1 scripts/drills/pod-kill.sh    # a crash: no grace at all
#
# Expected (the seed system's numbers): no 5xx, the fallback serving while the replica is gone;
# KubeRay recreates the pod and the pool comes back in 5-10 min (image pull, model load); the
# breaker's half-open probe brings traffic home. Settings: scripts/drills/lib.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"

need kubectl python3
gpu_pod >/dev/null  # fail before starting any load
start_load
sleep_until_event

victim=$(gpu_pod)
grace=()
how=graceful
if [ "${FORCE:-0}" = 1 ]; then grace=(--grace-period=0 --force); how=forced; fi
before=$(gpu_pods_now)
event_at=$(now)
log "killing $victim ($how)"
kubectl delete pod -n "$NAMESPACE" "$victim" --wait=false "${grace[@]}"
watch_recovery "$before" "$event_at"

finish "pod kill ($how): $victim" "$event_at"
