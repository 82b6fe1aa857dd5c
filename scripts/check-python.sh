#!/usr/bin/env bash
# Lint and type check of the Python package (python/lossguard_capture) and its tests: ruff (the rules of
# python/pyproject.toml [tool.ruff]) and mypy ([tool.mypy]), the versions scripts/setup.sh pins in the base
# venv ($LOSSGUARD_VENV, default ~/.cache/lossguard/venv). Exit 0 when clean, non-zero on any finding.
#
#     scripts/check-python.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LOSSGUARD_VENV:-$HOME/.cache/lossguard/venv}"
PY="$VENV/bin/python"
if ! "$PY" -c 'import ruff, mypy' 2>/dev/null; then
  echo "check-python: $PY has no ruff or mypy (scripts/setup.sh installs the pinned ones)" >&2
  exit 2
fi

status=0
cd "$ROOT"
# --no-cache: nothing written into the source tree (ctest runs it from a build folder).
"$PY" -m ruff check --no-cache python/lossguard_capture python/tests || status=1
# mypy reads python/pyproject.toml from python/ (its `files`, the trainer packages' ignore_missing_imports);
# its cache goes to a temporary folder for the same reason.
cache="$(mktemp -d)"
trap 'rm -rf "$cache"' EXIT
(cd python && "$PY" -m mypy --cache-dir "$cache") || status=1
exit $status
