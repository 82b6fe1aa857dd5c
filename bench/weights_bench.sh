#!/usr/bin/env bash
# `weights` with the default I5 variations against `count --cp 1,2,4,8` on the same dump, in one run
# (issue target: the weights summary within 2x the count):
#   bench/weights_bench.sh BUILD_DIR [RUNS] [CONTRACT]
# Generates the 10 M-response-token masks-only dump of docs/benchmarks.md (gen --samples 100000
# --max-response 200 --masks-only), then times, best of RUNS each, end to end (process start, load,
# work, text report): count --cp 1,2,4,8; weights --contract CONTRACT (default relax) --dp 2
# --microbatches 2 --cp 2 with the ten I5 variations; and the same with --vary none. Prints the
# times, peak RSS and the ratios to count.
set -euo pipefail
build="${1:?usage: bench/weights_bench.sh BUILD_DIR [RUNS] [CONTRACT]}"
runs="${2:-5}"
contract="${3:-relax}"
lg="$build/cli/lossguard"
dir=$(mktemp -d /tmp/lossguard-weights-bench.XXXX)
trap 'rm -rf "$dir"' EXIT
"$lg" gen --samples 100000 --max-response 200 --masks-only --seed 7 --out "$dir/big.safetensors" \
  >/dev/null
best() {  # best wall seconds and its peak RSS (KiB) over $runs runs of "$@" (exit 1 is a verdict)
  local best_s="" best_kb=""
  for _ in $(seq "$runs"); do
    /usr/bin/time -q -f "%e %M" -o "$dir/t" "$@" >/dev/null || [ $? -eq 1 ]
    read -r s kb <"$dir/t"
    if [ -z "$best_s" ] || awk "BEGIN{exit !($s < $best_s)}"; then best_s=$s; best_kb=$kb; fi
  done
  echo "$best_s $best_kb"
}
layout=(--dp 2 --microbatches 2 --cp 2)
read -r count count_kb < <(best "$lg" count "$dir/big.safetensors" --cp 1,2,4,8)
read -r full full_kb < <(best "$lg" weights "$dir/big.safetensors" --contract "$contract" "${layout[@]}")
read -r none none_kb < <(best "$lg" weights "$dir/big.safetensors" --contract "$contract" \
  "${layout[@]}" --vary none)
awk -v c="$count" -v f="$full" -v n="$none" -v kc="$count_kb" -v kf="$full_kb" -v kn="$none_kb" \
  -v contract="$contract" 'BEGIN {
  printf "10 M response tokens (100,000 samples), best of runs, end to end:\n"
  printf "  count --cp 1,2,4,8                          %6.2f s  %5.0f MB\n", c, kc / 1024
  printf "  weights --contract %-12s with I5      %6.2f s  %5.0f MB  ratio %.2f (target <= 2)\n", contract, f, kf / 1024, f / c
  printf "  weights --contract %-12s --vary none  %6.2f s  %5.0f MB  ratio %.2f\n", contract, n, kn / 1024, n / c
}'
