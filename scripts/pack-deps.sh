#!/usr/bin/env bash
# Gathers the C++ libraries lossguard builds against (headers of fmt, nlohmann-json, CLI11 and Gloo, and
# GoogleTest's sources) from this Debian machine into one folder, for a machine that cannot install them:
# the lent GPU machines reach no package archive. There: cmake -DLOSSGUARD_DEPS_DIR=<folder> (see
# scripts/gpu-check). About 6 MiB.
#   scripts/pack-deps.sh [FOLDER]        (default .deps, which git ignores)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.deps}"
rm -rf "$out"
mkdir -p "$out/include"
for d in fmt nlohmann CLI gloo; do
  [ -d "/usr/include/$d" ] || { echo "pack-deps: /usr/include/$d missing: run scripts/setup.sh first" >&2; exit 2; }
  cp -r "/usr/include/$d" "$out/include/"
done
cp -r /usr/src/googletest "$out/googletest"
du -sh "$out"
