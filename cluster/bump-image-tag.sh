#!/usr/bin/env bash
# Point the Forge deployment at new images: rewrite the tag on every line marked
# `# forge-image-tag` in cluster/apps/forge.yaml (the chart's image values) and
# cluster/forge/eval-gate.yaml (the post-switch check's image), and nothing else. CI runs it once
# the eval gate passed against the pushed images, commits the change to main and fast-forwards
# `production` (what ArgoCD follows) to that commit (.github/workflows/deploy.yml);
# tests/deploy/test_cluster.py runs it on a copy, and tests/deploy/test_images_and_workflow.py runs
# the workflow's whole step on a scratch repository.
#
#   cluster/bump-image-tag.sh <tag> [root]      # root: the tree to edit (default: this checkout)
set -euo pipefail

tag="${1:?usage: $0 <tag> [root]}"
root="${2:-$(cd "$(dirname "$0")/.." && pwd)}"

# A Docker tag (also keeps the sed expressions below literal).
if ! [[ "$tag" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]]; then
  echo "bump-image-tag: not a valid image tag: $tag" >&2
  exit 2
fi

files=("$root/cluster/apps/forge.yaml" "$root/cluster/forge/eval-gate.yaml")
marker='# forge-image-tag'
for file in "${files[@]}"; do
  # `tag: "<old>"  # forge-image-tag`  and  `image: <repository>:<old>  # forge-image-tag`
  sed -i -E \
    -e "s/^([[:space:]]*tag: )\"[^\"]*\"([[:space:]]+${marker})\$/\\1\"${tag}\"\\2/" \
    -e "s/^([[:space:]]*image: [^:[:space:]]+):[^[:space:]]+([[:space:]]+${marker})\$/\\1:${tag}\\2/" \
    "$file"
done

# Every marked line now carries the tag, or the layout changed under this script: fail loudly.
marked=$(cat "${files[@]}" | grep -v -E '^[[:space:]]*#' | grep -c -- "$marker" || true)
bumped=$(cat "${files[@]}" | grep -v -E '^[[:space:]]*#' | grep -- "$marker" \
  | grep -c -E -- "(\"${tag}\"|:${tag})[[:space:]]+${marker}\$" || true)
if [ "$marked" -eq 0 ] || [ "$marked" -ne "$bumped" ]; then
  echo "bump-image-tag: $bumped of $marked marked lines carry $tag" >&2
  exit 1
fi
echo "bump-image-tag: $marked lines now at $tag"
