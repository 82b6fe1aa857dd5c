#!/usr/bin/env bash
# A longer fuzz campaign than the CI smoke run: RUNS executions (default 1,000,000) of every target,
# ASan + UBSan, seeded from the fixtures; prints each target's execution count and speed.
#   scripts/fuzz-long.sh [RUNS] [TARGET...]    (after `make test-fuzz`, which builds build-fuzz/)
# FUZZ_BUILD=DIR takes another fuzz build, e.g. one configured with -DLOSSGUARD_SANITIZERS=undefined
# (no ASan: several times faster, for a million audits of fuzz_capture on two cores).
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-1000000}"
shift || true
build="${FUZZ_BUILD:-build-fuzz}"
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(safetensors pickle json batch capture contract)
for t in "${targets[@]}"; do
  dir=$(mktemp -d)
  bash tests/fuzz/make_corpus.sh "$t" fixtures/data "$dir"
  start=$(date +%s)
  # a crashing input goes to ${FUZZ_ARTIFACTS:-/tmp}/lossguard-fuzz-TARGET-crash-* (not into the tree);
  # keep it as tests/fuzz/regressions/TARGET-NAME once fixed: every later run starts from it
  "$build/tests/fuzz/fuzz_$t" -runs="$runs" -print_funcs=0 -print_final_stats=1 -max_len=65536 -timeout=10 \
    -artifact_prefix="${FUZZ_ARTIFACTS:-/tmp}/lossguard-fuzz-$t-" \
    -rss_limit_mb=2048 "$dir" 2>&1 | grep -E "stat::number_of_executed_units|ERROR|SUMMARY" | sed "s/^/$t: /"
  echo "$t: $(( $(date +%s) - start )) s"
  rm -rf "$dir"
done
