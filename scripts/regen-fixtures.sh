#!/usr/bin/env bash
# Regenerates the committed fixtures: the `lossguard gen` dumps, the dumps torch.save / safetensors
# write, and every expected/<dump>.json (what torch.load, safetensors or json read). Review the data diff.
set -euo pipefail
LG=$(realpath "$1"); PY="$2"
cd "$(dirname "$0")/../fixtures/data"
rm -rf expected gen_*
for c in cp-examples empty-responses fully-masked zero-token sft-preshifted sft-not-preshifted t-zero random; do
  for e in safetensors pt json; do
    "$LG" gen --case "$c" --samples 6 --vocab 8 --max-prompt 6 --max-response 6 --out "gen_$c.$e" >/dev/null
  done
done
"$PY" ../make_torch_fixtures.py --out .
