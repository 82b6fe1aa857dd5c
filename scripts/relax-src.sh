#!/usr/bin/env bash
# Materialises, OUTSIDE this repository, the files of redai-studio/Relax that the real-source tier of the
# Relax tests runs (tests/trainers/test_relax_source.py): every file of the "tier" and "transplants" lists of
# tests/trainers/relax_source_manifest.json, each at its own commit, as
#
#     DEST/<full commit hash>/relax/backends/megatron/loss.py ...
#
# No Relax code is kept in this repository: the tests read these files at run time from the folder named by
# LOSSGUARD_RELAX_SRC (this script's DEST).
#
#     RELAX_GIT=/path/to/Relax scripts/relax-src.sh DEST     # read from a clone you have (bare or not)
#     scripts/relax-src.sh DEST                              # clones the upstream (bare) into DEST/.relax.git
#     LOSSGUARD_RELAX_SRC=DEST ~/.cache/lossguard/venv-megatron/bin/python -m pytest -q \
#         tests/trainers/test_relax_source.py
#
# Each file's sha256 is checked against the manifest's. It writes nothing outside DEST.
set -euo pipefail

usage() {
  sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
[[ $# -eq 1 && "$1" != "-h" && "$1" != "--help" ]] || usage
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MANIFEST="$ROOT/tests/trainers/relax_source_manifest.json"
DEST="$(realpath -m "$1")"
case "$DEST/" in
  "$ROOT/"*) echo "relax-src: DEST ($DEST) is inside the repository ($ROOT); name a folder outside it" >&2; exit 2 ;;
esac
mkdir -p "$DEST"
UPSTREAM="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["upstream"])' "$MANIFEST")"

if [[ -n "${RELAX_GIT:-}" ]]; then
  if [[ -d "$RELAX_GIT/.git" ]]; then GIT_DIR_="$RELAX_GIT/.git"; else GIT_DIR_="$RELAX_GIT"; fi
else
  GIT_DIR_="$DEST/.relax.git"
  if [[ ! -d "$GIT_DIR_" ]]; then
    echo "relax-src: cloning $UPSTREAM into $GIT_DIR_" >&2
    if ! git clone --quiet --bare "$UPSTREAM" "$GIT_DIR_"; then
      rm -rf "$GIT_DIR_"
      echo "relax-src: could not clone $UPSTREAM (offline?): clone it where the network is, then" \
           "RELAX_GIT=/some/where/Relax.git scripts/relax-src.sh $DEST" >&2
      exit 1
    fi
  fi
fi

status=0
# commit, path, sha256 of every file of the tier and the transplants
while read -r commit path sha; do
  out="$DEST/$commit/$path"
  mkdir -p "$(dirname "$out")"
  if ! git --git-dir="$GIT_DIR_" show "$commit:$path" > "$out.partial" 2>/dev/null; then
    echo "relax-src: $GIT_DIR_ has no $commit:$path (fetch it there: git --git-dir=$GIT_DIR_ fetch origin)" >&2
    rm -f "$out.partial"
    status=1
    continue
  fi
  got="$(sha256sum "$out.partial" | cut -d' ' -f1)"
  if [[ "$got" != "$sha" ]]; then
    echo "relax-src: $commit:$path has sha256 $got, the manifest says $sha" >&2
    status=1
  fi
  mv "$out.partial" "$out"
  echo "$out"
done < <(python3 - "$MANIFEST" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
for e in m["tier"] + m.get("transplants", []):
    print(e["commit"], e["path"], e["sha256"])
PY
)
exit $status
