#!/usr/bin/env bash
# Replay simulator scale: wall time and peak memory of `lossguard replay --backend sim` for growing
# topologies up to TP8 PP16 CP8 DP128 (131,072 ranks), every protocol, on a zero-token batch (the case
# that exercises the broadcast and the deadlocking paths). Time per rank shows the cost stays linear.
# Then the data-dependent participation protocols at 16,384 and 131,072 ranks with EP 8, on a batch
# with tokens cut into 4 micro-batches per DP rank, or into uneven ones by --max-tokens-per-mb, and a
# NaN on rank 5.
#   bench/replay_bench.sh BUILD_DIR
set -euo pipefail
LG="$1/cli/lossguard"
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT

header() { printf '%-24s %-8s %9s %9s %12s %10s\n' protocol ranks wall_s rss_MiB us_per_rank exit; }
# measure PROTOCOL TP PP CP DP REPLAY-ARGS...: one timed replay, one row of the table.
measure() {
  local p=$1 tp=$2 pp=$3 cp=$4 dp=$5
  shift 5
  set +e
  /usr/bin/time -f '%e %M' -o "$dir/t" "$LG" replay "$@" --tp "$tp" --pp "$pp" --cp "$cp" --dp "$dp" \
    --protocol "$p" >/dev/null 2>&1
  local rc=$?
  set -e
  local wall rss
  read -r wall rss < <(tail -n 1 "$dir/t")
  local ranks=$((tp * pp * cp * dp))
  printf '%-24s %-8s %9s %9.0f %12.2f %10s\n' "$p" $ranks "$wall" $((rss / 1024)) \
    "$(awk -v w="$wall" -v n="$ranks" 'BEGIN { print w * 1000000 / n }')" $rc
}

"$LG" gen --case zero-token --samples 256 --out "$dir/zero.safetensors" >/dev/null
header
for topo in "8 16 8 16" "8 16 8 32" "8 16 8 64" "8 16 8 128"; do
  read -r tp pp cp dp <<<"$topo"
  for p in pr285 pr285-src-local pr285-always-broadcast values0 no-skip; do
    measure $p $tp $pp $cp $dp "$dir/zero.safetensors"
  done
done

"$LG" gen --samples 2048 --seed 5 --out "$dir/tokens.safetensors" >/dev/null
declare -A extra=(
  [microbatch-skip]="--microbatches 4" [microbatch-skip-local]="--microbatches 4"
  [microbatches-max]="--max-tokens-per-mb 200" [microbatches-local]="--max-tokens-per-mb 200"
  [nan-skip]="--nan-ranks 5" [nan-skip-local]="--nan-ranks 5" [nan-skip-rank0]="--nan-ranks 5"
  [flag-broadcast]="" [flag-broadcast-src-local]="")
echo
header
for topo in "8 16 8 16" "8 16 8 128"; do
  read -r tp pp cp dp <<<"$topo"
  for p in microbatch-skip microbatch-skip-local microbatches-max microbatches-local nan-skip \
           nan-skip-local nan-skip-rank0 flag-broadcast flag-broadcast-src-local; do
    # shellcheck disable=SC2086
    measure $p $tp $pp $cp $dp "$dir/tokens.safetensors" --ep 8 ${extra[$p]}
  done
done
