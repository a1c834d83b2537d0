#!/usr/bin/env bash
# Secret scan: fails when a file holds a potential secret that .secrets.baseline does not list.
#
#   scripts/secret_scan.sh            scan the repository (CI runs this)
#   scripts/secret_scan.sh FILE...    scan these files only
#   scripts/secret_scan.sh --update   rewrite the baseline from the tree, keeping its audit marks;
#                                     then `.venv/bin/detect-secrets audit .secrets.baseline`
#
# The repository is every file git tracks plus new ones not yet added (and not ignored), so a
# secret is caught before its commit as well as on CI's clean checkout. The baseline holds only
# audited false positives (test and demo keys, digests, names of variables and Kubernetes
# secrets): an entry not marked `"is_secret": false` fails the scan too, so nothing enters it
# unaudited. A finding is matched by file, type and a hash of the secret, not by line, so edits
# that move a baselined line pass. detect-secrets comes from the dev extra (pip install -e
# '.[dev]'); DETECT_SECRETS_BIN names another directory holding it.
set -euo pipefail
cd "$(dirname "$0")/.."

bin="${DETECT_SECRETS_BIN:-.venv/bin}"
baseline=.secrets.baseline

repository_files() {
  # The baseline itself is made of hashes; everything else git knows of, or would add.
  git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do
        [ -f "$f" ] && [ "$f" != "$baseline" ] && printf '%s\0' "$f"
      done
}

if [ "${1:-}" = "--update" ]; then
  mapfile -d '' files < <(repository_files)
  "$bin/detect-secrets" scan --baseline "$baseline" "${files[@]}"
  echo "Updated $baseline. Audit what is new: $bin/detect-secrets audit $baseline" >&2
  exit 0
fi

if [ "$#" -gt 0 ]; then
  files=("$@")
else
  mapfile -d '' files < <(repository_files)
fi

# Every baseline entry must have been audited as a false positive.
unaudited=$("$bin/python" - "$baseline" <<'EOF'
import json
import sys

with open(sys.argv[1]) as f:
    results = json.load(f)["results"]
for path, findings in sorted(results.items()):
    for finding in findings:
        if finding.get("is_secret") is not False:
            print(f"  {path}:{finding['line_number']}: {finding['type']}")
EOF
)
if [ -n "$unaudited" ]; then
  echo "secret scan: $baseline has entries not audited as false positives:" >&2
  echo "$unaudited" >&2
  echo "Audit them (detect-secrets audit $baseline), or remove the secret." >&2
  exit 1
fi

# The hook reports what the baseline does not list (exit 1). It may also rewrite the baseline's
# line numbers (exit 3): it works on a copy, so CI never edits a tracked file and moved lines pass.
copy=$(mktemp)
trap 'rm -f "$copy"' EXIT
cp "$baseline" "$copy"
status=0
report=$("$bin/detect-secrets-hook" --baseline "$copy" "${files[@]}" 2>&1) || status=$?
case "$status" in
  0 | 3) echo "secret scan: ${#files[@]} files, no secret outside $baseline" ;;
  *)
    echo "$report" >&2
    echo "secret scan: potential secrets not in $baseline (above). Remove them; or, if one is" \
      "not a secret, run scripts/secret_scan.sh --update and audit it." >&2
    exit 1
    ;;
esac
