#!/usr/bin/env bash
# The demo on bundled examples: lossguard catching the three bugs of Relax PR #285, one after the other.
set -uo pipefail
LG="$1"
cd "$(dirname "$0")/.."
EX=fixtures/data
step() { printf '\n\033[1m== %s\033[0m\n$ %s\n' "$1" "$2"; }

step "What is in a dumped batch" "lossguard inspect $EX/gen_empty-responses.safetensors"
"$LG" inspect "$EX/gen_empty-responses.safetensors"; echo "(exit code $?)"

step "A Relax rollout dump, written by real torch.save (loaded without running pickled code)" \
     "lossguard inspect $EX/torch_relax_rollout.pt"
"$LG" inspect "$EX/torch_relax_rollout.pt"; echo "(exit code $?)"

step "A hostile pickle is refused, nothing executed" "lossguard inspect $EX/hostile_os_system.pt"
"$LG" inspect "$EX/hostile_os_system.pt"; echo "(exit code $?)"
