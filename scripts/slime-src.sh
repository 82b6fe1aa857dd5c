#!/usr/bin/env bash
# Materialises, OUTSIDE this repository, the files of THUDM/slime that the real-source tiers of the slime
# tests run: the "history" tier (tests/trainers/test_slime_history.py, tests/trainers/slime_history_manifest.json:
# slime's real loss module and what it imports from slime, at four commits) and the "source" tier
# (tests/trainers/test_slime_source.py, tests/trainers/slime_source_manifest.json: the training step itself —
# initialize.py, model.py, data.py, loss.py and their imports — at the head commit), each commit as
#
#     DEST/<full commit hash>/slime/backends/megatron_utils/loss.py ...
#
# No slime code is kept in this repository: the tests read these files at run time from the folder named
# by LOSSGUARD_SLIME_SRC (this script's DEST).
#
#     scripts/slime-src.sh DEST [COMMIT...]                  # default: the five commits of both manifests
#     SLIME_GIT=/path/to/slime scripts/slime-src.sh DEST     # read from a clone you have (bare or not)
#     LOSSGUARD_SLIME_SRC=DEST ~/.cache/lossguard/venv-megatron/bin/python -m pytest -q \
#         tests/trainers/test_slime_history.py
#
# Without SLIME_GIT it clones https://github.com/THUDM/slime (bare) into DEST/.slime.git (needs the network;
# reused by a second run).  It writes nothing outside DEST.
set -euo pipefail

# the commits and files of tests/trainers/slime_history_manifest.json (keep in step with it)
DEFAULT_COMMITS=(
  4d837ff588fb4056ad3a6742b53a9900962ddd99   # (B) parent: per-token loss x num_microbatches / gbs x dp*cp
  763f18d5bd24deb456e863086455983d474ffb75   # (B) fix #987: no scale on the per-token path
  9e5a857e507f95245e88ab567dda8a9b62a24fc4   # (A) parent: per-token loss not x cp
  f9f00b2cba3c31d8e80e9ceb50750cd32ea068c1   # (A) fix #990: per-token loss x cp
  624b824a898ab0ec1fcb4d373004c7f3852bf515   # the source tier's head (main, 2026-08-21): HEAD_FILES
)
FILES=(
  slime/backends/megatron_utils/loss.py
  slime/backends/megatron_utils/cp_utils.py
  slime/utils/ppo_utils.py
  slime/utils/types.py
  slime/utils/distributed_utils.py
)
# the source tier's commit and files (tests/trainers/slime_source_manifest.json's "real": keep in step with it)
HEAD_COMMIT=624b824a898ab0ec1fcb4d373004c7f3852bf515
HEAD_FILES=(
  slime/__init__.py
  slime/backends/__init__.py
  slime/backends/megatron_utils/__init__.py
  slime/backends/megatron_utils/initialize.py
  slime/backends/megatron_utils/model.py
  slime/backends/megatron_utils/data.py
  slime/backends/megatron_utils/loss.py
  slime/backends/megatron_utils/cp_utils.py
  slime/backends/megatron_utils/checkpoint.py
  slime/backends/megatron_utils/model_provider.py
  slime/backends/megatron_utils/stateless_adam.py
  slime/backends/megatron_utils/megatron_patch/__init__.py
  slime/backends/megatron_utils/megatron_patch/megatron_chunked_grad_coalesce_patch.py
  slime/observability/__init__.py
  slime/observability/train_metric_utils.py
  slime/observability/metric_utils.py
  slime/observability/timer.py
  slime/utils/__init__.py
  slime/utils/accelerator/__init__.py
  slime/utils/accelerator/base.py
  slime/utils/accelerator/cuda.py
  slime/utils/accelerator/musa.py
  slime/utils/accelerator/torch_accelerator.py
  slime/utils/misc.py
  slime/utils/types.py
  slime/utils/ppo_utils.py
  slime/utils/distributed_utils.py
  slime/utils/flops_utils.py
)
UPSTREAM="https://github.com/THUDM/slime"

usage() {
  sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}
[[ $# -ge 1 && "$1" != "-h" && "$1" != "--help" ]] || usage
DEST="$1"
shift
COMMITS=("$@")
[[ ${#COMMITS[@]} -gt 0 ]] || COMMITS=("${DEFAULT_COMMITS[@]}")

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$(realpath -m "$DEST")"
case "$DEST/" in
  "$ROOT/"*) echo "slime-src: DEST ($DEST) is inside the repository ($ROOT); name a folder outside it" >&2; exit 2 ;;
esac
mkdir -p "$DEST"

# the git directory to read: $SLIME_GIT (a work tree's .git, or a bare clone/mirror), else a bare clone here
if [[ -n "${SLIME_GIT:-}" ]]; then
  if [[ -d "$SLIME_GIT/.git" ]]; then GIT_DIR_="$SLIME_GIT/.git"; else GIT_DIR_="$SLIME_GIT"; fi
else
  GIT_DIR_="$DEST/.slime.git"
  if [[ ! -d "$GIT_DIR_" ]]; then
    echo "slime-src: cloning $UPSTREAM into $GIT_DIR_" >&2
    if ! git clone --quiet --bare "$UPSTREAM" "$GIT_DIR_"; then
      rm -rf "$GIT_DIR_"
      cat >&2 <<EOF
slime-src: could not clone $UPSTREAM (offline?).  Provide a clone of THUDM/slime that holds the commits:
    git clone --bare $UPSTREAM /some/where/slime.git      # on a machine with the network, then copy it
    SLIME_GIT=/some/where/slime.git scripts/slime-src.sh $DEST
EOF
      exit 1
    fi
  fi
fi
git_() { git --git-dir="$GIT_DIR_" "$@"; }

status=0
for c in "${COMMITS[@]}"; do
  if ! full="$(git_ rev-parse --quiet --verify "$c^{commit}" 2>/dev/null)"; then
    echo "slime-src: $c is not a commit of $GIT_DIR_ (fetch it there: git --git-dir=$GIT_DIR_ fetch origin)" >&2
    status=1
    continue
  fi
  out="$DEST/$full"
  tmp="$(mktemp -d "$DEST/.partial.XXXXXX")"
  ok=1
  if [[ $full == "$HEAD_COMMIT" ]]; then files=("${HEAD_FILES[@]}"); else files=("${FILES[@]}"); fi
  for f in "${files[@]}"; do
    mkdir -p "$tmp/$(dirname "$f")"
    if ! git_ show "$full:$f" > "$tmp/$f" 2>/dev/null; then
      echo "slime-src: $full has no readable $f" >&2
      ok=0
    fi
  done
  if [[ $ok == 1 ]]; then
    printf 'repository %s\ncommit %s\n%s\n' "$UPSTREAM" "$full" "$(printf 'file %s\n' "${files[@]}")" > "$tmp/SOURCE"
    rm -rf "$out"
    mv "$tmp" "$out"
    echo "$out"
  else
    rm -rf "$tmp"
    status=1
  fi
done
exit $status
