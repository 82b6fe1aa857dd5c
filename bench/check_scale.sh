#!/usr/bin/env bash
# `check` at real scale against its own yardstick, measured in the same run: one fused-kernel pass over
# the same logits (build/bench/xent_throughput, best of 5), then `check --cp 1,4` with each candidate,
# round after round so that a drift in the machine's speed moves both. Prints every round, then the
# medians: check's wall time as a multiple of one kernel pass per CP size (the target is at most 10x),
# and peak resident memory as a multiple of the dump's size (target: at most 1.5x).
#   bench/check_scale.sh BUILD_DIR [DUMP [ROUNDS]]
# Without DUMP, a real-shaped one is generated (16 samples, 4,331 response tokens, bf16 logits over a
# 151,936 vocabulary: 1.3 GB) in a temporary folder.
set -euo pipefail
build=$1
lg="$build/cli/lossguard"
rounds=${3:-3}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
dump=${2:-}
if [[ -z "$dump" ]]; then
  dump="$dir/real.safetensors"
  "$lg" gen --out "$dump" --samples 16 --max-response 652 --max-prompt 64 --vocab 151936 \
    --dtype bfloat16 >/dev/null
fi
# The dump's shape, from inspect --json: response rows, vocabulary, dtype of the logits.
"$lg" inspect "$dump" --json "$dir/i.json" >/dev/null
read -r rows vocab dtype < <(python3 - "$dir/i.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
f = next(f for f in d["fields"] if f["name"] == "logits")
rows, vocab = (int(x) for x in f["shape"].strip("[]").split(","))
print(rows, vocab, f["dtype"])
PY
)
bytes=$(stat -c %s "$dump")
cp_sizes=2
printf '%-6s %12s %14s %10s %14s %10s\n' round kernel_pass_s kernels_wall_s kernels_MB torch_wall_s torch_MB
for ((r = 1; r <= rounds; r++)); do
  pass=$("$build/bench/xent_throughput" --rows "$rows" --vocab "$vocab" --dtype "$dtype" |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["fused_xent_s"])')
  line="$r $pass"
  for impl in kernels torch; do
    /usr/bin/time -f '%e %M' -o "$dir/t" "$lg" check "$dump" --cp 1,4 --impl "$impl" >"$dir/out" 2>&1 ||
      { cat "$dir/out"; exit 1; }
    read -r wall rss < <(tail -n 1 "$dir/t")
    line="$line $wall $((rss / 1024))"
  done
  echo "$line" >>"$dir/rounds"
  printf '%-6s %12.3f %14s %10s %14s %10s\n' $line
done
python3 - "$dir/rounds" "$cp_sizes" "$bytes" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1])]
cps, size_mb = int(sys.argv[2]), int(sys.argv[3]) / 2**20
med = [statistics.median(col) for col in zip(*rows)]
_, kpass, kwall, kmb, twall, tmb = med
print(f"median: kernel pass {kpass:.3f} s; dump {size_mb:.0f} MiB")
for name, wall, mb in (("kernels", kwall, kmb), ("torch", twall, tmb)):
    print(f"  --impl {name:<7} {wall:6.2f} s = {wall / (kpass * cps):5.1f}x one kernel pass per CP size "
          f"(target <= 10x); peak {mb:.0f} MiB = {mb / size_mb:.2f}x the dump (target <= 1.5x)")
PY
