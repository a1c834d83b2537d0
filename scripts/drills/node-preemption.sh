#!/usr/bin/env bash
# Drill: preempt the spot node under a GPU worker, under steady in-cluster load, then print
# requests, served by the fallback, 5xx, client-visible errors and p50/p95, before and after the
# preemption and per minute.
#
#   GCP_PROJECT=forge-prod scripts/drills/node-preemption.sh
#
# `gcloud compute instances simulate-maintenance-event` on a spot VM preempts it the way Compute
# Engine does (the 30 s notice, then the stop); GKE's node names are the VMs' names. Expected (the
# seed system's numbers): no 5xx, the fallback serving; the node pool replaces the node and the pool
# is back in 10-15 min. Settings: scripts/drills/lib.sh, plus GCP_PROJECT [gcloud's project].
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"

need kubectl gcloud python3
project="${GCP_PROJECT:-$(gcloud config get-value project 2>/dev/null)}"
[ -n "$project" ] || die "set GCP_PROJECT (or gcloud config set project)"
gpu_pod >/dev/null
start_load
sleep_until_event

victim=$(gpu_pod)
node=$(kubectl get pod -n "$NAMESPACE" "$victim" -o jsonpath='{.spec.nodeName}')
zone=$(kubectl get node "$node" -o jsonpath='{.metadata.labels.topology\.kubernetes\.io/zone}')
[ -n "$node" ] && [ -n "$zone" ] || die "no node or zone for $victim"
before=$(gpu_pods_now)
event_at=$(now)
log "preempting $node ($zone), under $victim"
gcloud compute instances simulate-maintenance-event "$node" \
  --zone "$zone" --project "$project" --async
watch_recovery "$before" "$event_at"

finish "node preemption: $node (pod $victim)" "$event_at"
