#!/usr/bin/env bash
# Regenerates the committed fixtures: the `lossguard gen` dumps, the dumps torch.save / safetensors
# write, every expected/<dump>.json (what torch.load, safetensors or json read), and every
# expected_losses/losses_<fixture>.json (PyTorch float64 losses and gradients of the JSON fixtures, for the
# oracle's test). The hand_*.json fixtures are written by hand and kept. Review the data diff.
set -euo pipefail
LG=$(realpath "$1"); PY="$2"
cd "$(dirname "$0")/../fixtures/data"
rm -rf expected expected_losses expected_slime slime_per_rank_cp2 gen_*
for c in cp-examples empty-responses fully-masked zero-token sft-preshifted sft-not-preshifted t-zero random; do
  for e in safetensors pt json; do
    "$LG" gen --case "$c" --samples 6 --vocab 8 --max-prompt 6 --max-response 6 --out "gen_$c.$e" >/dev/null
  done
done
"$PY" ../make_torch_fixtures.py --out .
"$PY" ../make_expected_losses.py --data . --out expected_losses
"$PY" ../make_slime_fixtures.py --out . --expected-dir expected_slime
# Audit captures recorded by a real DP 2 x CP 2 trainer under torchrun (tests/audit/mini_trainer.py): the
# bundled captures the installed wheel audits with no trainer (tests/wheel/), correct and with a per
# micro-batch mean.
rm -rf captures
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 ../../tests/audit/mini_trainer.py \
  --out captures/mini-dp2-cp2 --dp 2 --cp 2 --microbatches 2 --bug none,microbatch-mean --steps 1 >/dev/null
