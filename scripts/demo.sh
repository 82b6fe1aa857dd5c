#!/usr/bin/env bash
# The demo on bundled examples: lossguard catching the three bugs of Relax PR #285, one after the other,
# then the wider family of normalisation bugs as effective token weights.
set -uo pipefail
LG="$1"
cd "$(dirname "$0")/.."
EX=fixtures/data
step() { printf '\n\033[1m== %s\033[0m\n' "$1"; }
run() {
  printf '$ lossguard %s\n' "$*"
  "$LG" "$@"
  printf '(exit code %d)\n' $?
}

step "What is in a dumped batch (a Relax rollout dump written by real torch.save; no pickled code is run)"
run inspect "$EX/torch_relax_rollout.pt" --max-rows 10

step "Bug 1: CP=1 counted an empty response as 1 token, CP>1 as 0 -- the same batch, two denominators"
run count "$EX/gen_empty-responses.safetensors" --cp 1,2,4 --policy legacy --max-rows 8
step "Bug 1, fixed (Relax after PR #285): one denominator for every CP size"
run count "$EX/gen_empty-responses.safetensors" --cp 1,2,4 --max-rows 0 | tail -8
step "Bug 1 in the loss and gradient: the legacy CP=1 trainer against the float64 oracle"
run check "$EX/gen_empty-responses.safetensors" --cp 1,2,4 --policy legacy
step "Bug 1, fixed: the CP-sharded trainer (LibTorch autograd, and lossguard's fused kernels) matches the oracle, within bounds derived from each one's arithmetic; the dump's own token_loss is the nll of its logits"
run check "$EX/gen_random.safetensors" --cp 1,2,4,8 --loss nll,ppo-clip,given --reduce per-token,sample-mean --impl torch,kernels

step "Bug 2: a zero-token global batch still ran optimizer.step() (Megatron baseline: never skips)"
run replay "$EX/gen_zero-token.safetensors" --tp 2 --pp 2 --dp 2 --protocol no-skip
step "Bug 2: the kernels compute the zero-token flag on the device; the host reads it once, at the end"
run check "$EX/gen_zero-token.safetensors" --cp 1,2 --impl kernels
step "Bug 2, fixed: every rank skips optimizer and LR scheduler"
run replay "$EX/gen_zero-token.safetensors" --tp 2 --pp 2 --dp 2 --protocol pr285

step "Bug 3: the skip flag broadcast from a pipeline-local source rank: errors and a deadlock on TP2 PP2"
run replay "$EX/gen_zero-token.safetensors" --tp 2 --pp 2 --protocol pr285-src-local --svg /tmp/lossguard-demo-grid.svg
step "Bug 3: broadcasting even when PP=1 (8 ranks)"
run replay "$EX/gen_zero-token.safetensors" --dp 4 --cp 2 --protocol pr285-always-broadcast --max-lines 3
step "Bug 3: reading the decision from values[0], a sample count when per-token loss is off"
run replay "$EX/gen_zero-token.safetensors" --dp 2 --protocol values0 --reduce sample-mean

step "Bug 3 in a real job: 4 ranks over Gloo broadcast the skip flag at PP=1, Flight Recorder on; each rank dumps from its error or timeout path, and postmortem explains the hang from the dumps alone"
FR_PY="${LOSSGUARD_VENV:-$HOME/.cache/lossguard/venv}/bin/python"
FR=$(mktemp -d /tmp/lossguard-demo-fr.XXXX)
printf '$ TORCH_FR_BUFFER_SIZE=2000 TORCH_FR_DUMP_TEMP_FILE=fr/fr_trace_rank_ torchrun --nproc-per-node 4 tests/postmortem/fr_job.py --scenario seed-pp1-broadcast\n'
TORCH_FR_BUFFER_SIZE=2000 TORCH_FR_DUMP_TEMP_FILE="$FR/fr_trace_rank_" OMP_NUM_THREADS=1 "$FR_PY" -m torch.distributed.run \
  --standalone --nproc-per-node 4 tests/postmortem/fr_job.py --scenario seed-pp1-broadcast --out "$FR" --timeout 4 2>&1 \
  | grep -E "^rank" | sort || true
[ -e "$FR/fr_trace_rank_0" ] || echo "(the job did not run: $FR_PY needs torch)"
run postmortem "$FR" --world 4 --frames 1

step "The same hang family beyond the end of the step: a backward skipped on a rank's own empty micro-batch (DP rank 1's last one) leaves the DDP gradient all-reduce half issued"
run replay "$EX/replay_participation.json" --dp 2 --microbatches 2 --protocol microbatch-skip-local
step "Decided on the count all-reduced over DP+CP instead: every rank runs the same backwards"
run replay "$EX/replay_participation.json" --dp 2 --microbatches 2 --protocol microbatch-skip --max-lines 2
step "Dynamic batch size gives DP ranks 1 and 2 micro-batches: with MoE (EP 2) the lighter rank leaves the all-to-alls early; Relax's MAX all-reduce + dummy micro-batches fixes it"
run replay "$EX/replay_participation.json" --dp 2 --ep 2 --max-tokens-per-mb 9 --protocol microbatches-local
run replay "$EX/replay_participation.json" --dp 2 --ep 2 --max-tokens-per-mb 9 --protocol microbatches-max --max-lines 2
step "A NaN gradient on rank 1, the step skipped per rank before the norm's all-reduce (hangs) and on rank 0's word (steps with NaN)"
run replay "$EX/replay_participation.json" --tp 2 --dp 2 --protocol nan-skip-local --nan-ranks 1
run replay "$EX/replay_participation.json" --tp 2 --dp 2 --protocol nan-skip-rank0 --nan-ranks 1 --max-lines 2
step "A flag broadcast on the TP group with src = 0, a group-local index used as a global rank"
run replay "$EX/replay_participation.json" --tp 2 --dp 2 --protocol flag-broadcast-src-local --max-lines 3
step "Expert parallelism: Megatron's expert-layer groups over the same ranks"
run topo --pp 2 --dp 4 --ep 2 --max-rows 4

step "Bug 2 in a real slime dump: a format-2 train dump of two optimizer steps, the first without effective tokens; replayed step by step on the trainer's own DP layout"
run replay "$EX/slime_format2_two_steps.pt" --dp 2 --protocol no-skip --max-lines 2
run count "$EX/slime_format2_two_steps.pt" --cp 1,2 --step 1 --max-rows 4

step "Every normalisation bug changes one thing: each token's weight in the applied gradient. Bug 1 as weights:"
run weights "$EX/gen_empty-responses.safetensors" --contract relax-legacy --cp 2
step "The Hugging Face gradient-accumulation bug (2024): a mean per micro-batch, averaged over accumulation steps"
run weights "$EX/gen_random.safetensors" --contract hf-ga --dp 2 --microbatches 3 --svg /tmp/lossguard-demo-weights.svg
step "Its fix (num_items_in_batch counted across devices; the Trainer has no CP, so I5 varies DP and micro-batches), and Megatron's per-token contract under CP 2"
run weights "$EX/gen_random.safetensors" --contract hf-num-items-across-devices --dp 2 --microbatches 3 --vary dp,microbatches
run weights "$EX/gen_random.safetensors" --contract megatron-per-token --dp 2 --microbatches 3 --cp 2
step "A scale the layout sets is the founding bug: every CP rank counts whole samples (x1/cp) fails by default and names the layout where it vanishes; a declared 0.5 is a constant"
run weights "$EX/gen_random.safetensors" --contract count=full-sample,norm=global:dp-cp --cp 2 --vary none | grep -E "^weights:|^verdict"
run weights "$EX/gen_random.safetensors" --contract megatron-per-token,scale=0.5 --cp 2 --vary none | grep -E "^weights:|^verdict"
step "A constant uniform scale passes only where Adam hides it: gradients x s are Adam with eps/s, so x1e-30 stops the update (and a negative scale, gradient ascent, always fails)"
run weights "$EX/gen_random.safetensors" --contract megatron-per-token,scale=1e-30 --vary dp,microbatches | grep -E "^weights:|^verdict"
step "A scale no trainer can apply, reached through symbols on a layout I5 tries (1e38 x M at M = 4), is refused by name"
run weights "$EX/gen_random.safetensors" --contract megatron-per-token,scale=1e38*M
step "The same trainer's own layout for TRL: DP x M must cut the completions evenly; other layouts are skipped and said so"
run weights "$EX/gen_random.safetensors" --reduce sample-mean --contract trl-grpo --dp 2 --microbatches 3 --vary dp,microbatches | tail -6
step "The same bug through a trainer's real autograd: check --contract trains every micro-batch under it"
run check "$EX/gen_random.safetensors" --cp 1,2 --dp 2 --microbatches 3 --contract hf-ga --impl torch,kernels

step "Audit a real trainer: a DP x CP job under torchrun records what it did (lossguard-capture), lossguard judges it"
PY="${LOSSGUARD_VENV:-$HOME/.cache/lossguard/venv}/bin/python"
CAP=$(mktemp -d /tmp/lossguard-demo-captures.XXXX)
printf '$ torchrun --nproc-per-node 4 tests/audit/mini_trainer.py --dp 2 --cp 2 --microbatches 2 --bug none,microbatch-mean ...\n'
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 tests/audit/mini_trainer.py \
  --out "$CAP" --dp 2 --cp 2 --microbatches 2 --bug none,microbatch-mean --steps 2 --empty-step 1 >/dev/null 2>&1 \
  || echo "(the mini trainer did not run: $PY needs torch)"
run audit "$CAP/none"
step "The same trainer with a mean per micro-batch: audit measures it, names the shape and the contract that reproduces it"
run audit "$CAP/microbatch-mean" --svg /tmp/lossguard-demo-audit.svg

step "Multi-term losses: a KL term averaged per micro-batch while the policy term uses the global count (NeMo-RL #3791, verl #7200): named per term, relative to the policy"
run weights "$EX/gen_random.safetensors" --contract megatron-per-token --term kl:per-token:0.1 --contract kl=norm=microbatch --term mtp:per-token:0.3:roll:1 --dp 2 --microbatches 2 --vary none
step "Megatron-core 0.16's MTP loss under calculate_per_token_loss is divided by the main loss's count, not its own shifted one"
run weights "$EX/gen_random.safetensors" --contract megatron-per-token --term mtp:per-token:0.3:roll:1 --contract mtp=megatron-mtp-per-token --dp 2 --vary none
step "The mini trainer with a KL, an MTP and an aux term, the KL averaged per micro-batch: audit measures each term's weights from its own hook"
printf '$ torchrun --nproc-per-node 4 tests/audit/mini_trainer.py --dp 2 --cp 2 --microbatches 2 --terms --bug none,kl-microbatch-mean ...\n'
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 tests/audit/mini_trainer.py \
  --out "$CAP/terms" --dp 2 --cp 2 --microbatches 2 --terms --bug none,kl-microbatch-mean --steps 1 >/dev/null 2>&1 \
  || echo "(the mini trainer did not run: $PY needs torch)"
run audit "$CAP/terms/none" | tail -4
run audit "$CAP/terms/kl-microbatch-mean"

step "The real Hugging Face Trainer, audited from its own loss path: lossguard_capture.hf.attach(trainer, \"captures\")"
HF_PY="${LOSSGUARD_VENV:-$HOME/.cache/lossguard/venv}-hf/bin/python"
if [ -x "$HF_PY" ]; then
  HFCAP=$(mktemp -d /tmp/lossguard-demo-hf.XXXX)
  printf '$ python examples/hf_trainer_audit.py --out captures   # transformers 5.24, GA 2, CPU\n'
  OMP_NUM_THREADS=1 "$HF_PY" examples/hf_trainer_audit.py --out "$HFCAP/kwargs" --lossguard-bin "$LG" 2>&1 \
    | grep -E "^lossguard_capture|^training" || true
  run audit "$HFCAP/kwargs/step000000"
  step "A model the Trainer gives no num_items_in_batch (accepts_loss_kwargs = False): fail fast stops step 0 before its update"
  printf '$ python examples/hf_trainer_audit.py --out captures --no-loss-kwargs\n'
  OMP_NUM_THREADS=1 "$HF_PY" examples/hf_trainer_audit.py --out "$HFCAP/nokwargs" --no-loss-kwargs --lossguard-bin "$LG" 2>&1 \
    | grep -E "^lossguard_capture|^training|weights |reproduced by" || true
  step "TRL's GRPOTrainer (examples/trl_audit.py, a tokenizer built in-process): loss_type dapo passes; bnpo (each micro-batch over its own tokens) is stopped before step 0's update"
  printf '$ python examples/trl_audit.py --out captures [--loss-type bnpo]\n'
  for lt in dapo bnpo; do
    OMP_NUM_THREADS=1 "$HF_PY" examples/trl_audit.py --out "$HFCAP/trl-$lt" --loss-type "$lt" --lossguard-bin "$LG" 2>&1 \
      | grep -E "^training|PASS|FAIL" | sed 's/^ *//' || true
  done
  step "The releases each adapter was verified on (make gallery runs the tests on every one), and a release it refuses, with the reason"
  PYTHONPATH=python "$HF_PY" - <<'EOF' 2>&1 || true
import lossguard_capture.hf as hf, lossguard_capture.trl as trl
for name, spec in (("hf", hf.SPEC), ("trl", trl.SPEC)):
    print(f"{name}: {spec.requirement}, verified on {', '.join(spec.verified)}")
try:
    hf.check_version("5.18.0")
except RuntimeError as e:
    print(str(e).split(".  Install")[0])
EOF
else
  echo "(skipped: $HF_PY is missing; scripts/setup-trainers.sh creates it)"
fi

step "Megatron-core's 1F1B pipeline schedule, audited from a loss function over logits (examples/megatron_audit.py)"
MG_PY="${LOSSGUARD_VENV:-$HOME/.cache/lossguard/venv}-megatron/bin/python"
if [ -x "$MG_PY" ]; then
  MGCAP=$(mktemp -d /tmp/lossguard-demo-megatron.XXXX)
  mg_run() { OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore "$MG_PY" -m torch.distributed.run --standalone "$@" 2>&1; }
  printf '$ torchrun --nproc-per-node 2 examples/megatron_audit.py --out captures   # PP 2, CPU\n'
  mg_run --nproc-per-node 2 examples/megatron_audit.py --out "$MGCAP/ok" --lossguard-bin "$LG" \
    | grep -E "^lossguard_capture|^rank" | sort || true
  run audit "$MGCAP/ok/step000000"
  step "The same with a mean per micro-batch: fail fast stops both stages before the optimizer applies step 0"
  printf '$ torchrun --nproc-per-node 2 examples/megatron_audit.py --out captures --bug\n'
  mg_run --nproc-per-node 2 examples/megatron_audit.py --out "$MGCAP/bug" --bug --lossguard-bin "$LG" \
    | grep -E "^lossguard_capture.*FAIL|^rank" | sort || true
  step "The skip decision broadcast from the pipeline's first stage (it holds no loss): every stage skips a step with 9 tokens"
  printf '$ torchrun --nproc-per-node 4 tests/trainers/megatron_shapes_driver.py --pp 2 --scenarios first-stage-src   # PP 2 x DP 2\n'
  mg_run --nproc-per-node 4 tests/trainers/megatron_shapes_driver.py --out "$MGCAP/pp" --pp 2 \
    --scenarios first-stage-src | grep -E "^lossguard_capture" | head -1 || true
  run audit "$MGCAP/pp/first-stage-src/adapter/captures/step000000"
  step "slime switched on by its own plug-in flags (--custom-megatron-init-path lossguard_capture.slime.init, --custom-megatron-before-train-step-hook-path ...): one rollout at CP 2, THD; slime's own empty-sample count and zero-token step named"
  printf '$ torchrun --nproc-per-node 2 tests/trainers/slime_relax_driver.py --cp 2 --scenarios pt   # slime as slime drives it\n'
  mg_run --nproc-per-node 2 tests/trainers/slime_relax_driver.py --out "$MGCAP/slime" --cp 2 --scenarios pt \
    | grep -E "^lossguard_capture" | head -1 || true
  SL="$MGCAP/slime/pt/adapter/captures"
  run audit "$SL/step000000" "$SL/step000001" "$SL/step000002" | grep -E '^[$] |^step|^  counts |^  decision |reproduced|verdict|exit code'
  step "Relax by the same flags (lossguard_capture.relax) at PP 2 x DP 2: after PR #285 the zero-token step is skipped on every stage; the skip decision broadcast from the pipeline's first stage (bug 3, planted) steps it"
  printf '$ torchrun --nproc-per-node 4 tests/trainers/slime_relax_driver.py --trainer relax --pp 2 --scenarios pt,bug-src\n'
  mg_run --nproc-per-node 4 tests/trainers/slime_relax_driver.py --trainer relax --out "$MGCAP/relax" --pp 2 \
    --scenarios pt,bug-src | grep -E "^lossguard_capture" | head -1 || true
  run audit "$MGCAP/relax/pt/adapter/captures/step000002" | grep -E '^[$] |^step|^  decision |^  metrics |verdict|exit code'
  run audit "$MGCAP/relax/bug-src/adapter/captures/step000002" | grep -E '^[$] |^step|^  decision |verdict|exit code'
  if [ -n "${LOSSGUARD_RELAX_SRC:-}" ]; then
    step "Relax's REAL loss.py, cp_utils.py and zero-token skip, read from LOSSGUARD_RELAX_SRC (scripts/relax-src.sh): its sft and reinforce++ paths at CP 2 and CP 1"
    printf '$ torchrun --nproc-per-node 2 tests/trainers/slime_relax_driver.py --trainer relax --cp 2 --scenarios sft --relax-src $LOSSGUARD_RELAX_SRC\n'
    mg_run --nproc-per-node 2 tests/trainers/slime_relax_driver.py --trainer relax --out "$MGCAP/relax-src" --cp 2 \
      --scenarios sft --relax-src "$LOSSGUARD_RELAX_SRC" | grep -E "^lossguard_capture" | head -1 || true
    run audit "$MGCAP/relax-src/sft/adapter/captures/step000000" | grep -E '^[$] |^step|^  weights |verdict|exit code'
  fi
  if [ -n "${LOSSGUARD_SLIME_SRC:-}" ]; then
    step "slime's OWN training step at its default branch (initialize.init, train_one_step, get_batch, loss_function, unedited; read from LOSSGUARD_SLIME_SRC, scripts/slime-src.sh) at CP 2: its fully masked sample counted as 1"
    printf '$ torchrun --nproc-per-node 2 tests/trainers/slime_relax_driver.py --cp 2 --scenarios pt --slime-source $LOSSGUARD_SLIME_SRC\n'
    mg_run --nproc-per-node 2 tests/trainers/slime_relax_driver.py --out "$MGCAP/slime-src" --cp 2 --scenarios pt \
      --slime-source "$LOSSGUARD_SLIME_SRC" | grep -E "^lossguard_capture" | head -1 || true
    run audit "$MGCAP/slime-src/pt/adapter/captures/step000001" | grep -E '^[$] |^step|^  counts |reproduced|verdict|exit code'
  fi
else
  echo "(skipped: $MG_PY is missing; scripts/setup-trainers.sh megatron creates it)"
fi

step "verl's own ppo_loss without an FSDP job (examples/verl_audit.py): token-mean passes; seq-mean-token-sum-norm without loss_scale_factor is stopped before the update"
VERL_PY="${LOSSGUARD_VENV:-$HOME/.cache/lossguard/venv}-verl/bin/python"
if [ -x "$VERL_PY" ]; then
  VCAP=$(mktemp -d /tmp/lossguard-demo-verl.XXXX)
  printf '$ python examples/verl_audit.py --out captures [--mode seq-mean-token-sum-norm]\n'
  for mode in token-mean seq-mean-token-sum-norm; do
    OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore "$VERL_PY" examples/verl_audit.py --out "$VCAP/$mode" --mode "$mode" \
      --lossguard-bin "$LG" 2>&1 | grep -E "PASS|FAIL|^step|^stopped" || true
  done
else
  echo "(skipped: $VERL_PY is missing; scripts/setup-trainers.sh verl creates it)"
fi

step "Write an adapter (docs/adapters/write-an-adapter.md): a whole one for a small training loop, examples/toy_adapter.py; its loop divides each micro-batch by its own count"
printf '$ python examples/toy_adapter.py --out captures --bug\n'
TOYCAP=$(mktemp -d /tmp/lossguard-demo-toy.XXXX)
OMP_NUM_THREADS=1 "$PY" examples/toy_adapter.py --out "$TOYCAP" --bug --lossguard-bin "$LG" 2>&1 || true
run audit "$TOYCAP/step000000" | grep -E '^[$] |^  weights |^  fix:|verdict|exit code'

step "What this binary needs to start: glibc and the C++ runtime; NCCL is found at run time (torch's nvidia-nccl wheel, the system), LibTorch by the commands that read .pt files"
printf '$ scripts/check-needed.sh %s\n' "$LG"
scripts/check-needed.sh "$LG"
run --version

step "And a hostile pickle is refused by name; nothing is executed"
run inspect "$EX/hostile_os_system.pt"
