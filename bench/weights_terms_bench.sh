#!/usr/bin/env bash
# Multi-term weights against single-term, in one run (SPEC §11; issue target: three terms within 3x one):
#   bench/weights_terms_bench.sh BUILD_DIR [RUNS]
# Generates a 10 M-response-token masks-only dump (100,000 samples, as docs/benchmarks.md's weights row),
# then times `lossguard weights` end to end, best of RUNS, on DP 8 x 8 micro-batches x CP 2 with the ten
# I5 variations: the main term alone, and main + a KL term (its own contract: a mean per micro-batch)
# + an MTP term at depth 1 (roll:1). Prints both times, their ratio and the peak RSS of each.
set -euo pipefail
build="${1:?usage: bench/weights_terms_bench.sh BUILD_DIR [RUNS]}"
runs="${2:-3}"
lg="$build/cli/lossguard"
dir=$(mktemp -d /tmp/lossguard-terms-bench.XXXX)
trap 'rm -rf "$dir"' EXIT
"$lg" gen --samples 100000 --min-prompt 16 --max-prompt 128 --max-response 200 --masks-only \
  --seed 7 --out "$dir/big.safetensors" >/dev/null
layout=(--dp 8 --microbatches 8 --cp 2)
best() {  # best wall seconds and its peak RSS (KiB) over $runs runs of "$@"
  local best_s="" best_kb=""
  for _ in $(seq "$runs"); do
    /usr/bin/time -q -f "%e %M" -o "$dir/t" "$@" >/dev/null || true
    read -r s kb <"$dir/t"
    if [ -z "$best_s" ] || awk "BEGIN{exit !($s < $best_s)}"; then best_s=$s; best_kb=$kb; fi
  done
  echo "$best_s $best_kb"
}
read -r one one_kb < <(best "$lg" weights "$dir/big.safetensors" --contract megatron-per-token "${layout[@]}")
read -r three three_kb < <(best "$lg" weights "$dir/big.safetensors" --contract megatron-per-token \
  --term kl:per-token:0.1 --contract kl=norm=microbatch --term mtp:per-token:0.3:roll:1 "${layout[@]}")
read -r good good_kb < <(best "$lg" weights "$dir/big.safetensors" --contract megatron-per-token \
  --term kl:per-token:0.1 --term mtp:per-token:0.3:roll:1 "${layout[@]}")
awk -v a="$one" -v b="$three" -v c="$good" -v ka="$one_kb" -v kb="$three_kb" -v kc="$good_kb" 'BEGIN {
  printf "weights, 10 M tokens, DP 8 x 8 micro-batches x CP 2, 10 I5 variations (best of runs):\n"
  printf "  one term                        %6.2f s  %5.0f MB\n", a, ka / 1024
  printf "  three terms, the KL per mb      %6.2f s  %5.0f MB  ratio %.2f (target <= 3)\n", b, kb / 1024, b / a
  printf "  three terms, all as declared    %6.2f s  %5.0f MB  ratio %.2f (target <= 3)\n", c, kc / 1024, c / a
}'
