#!/usr/bin/env bash
# Seed corpus for a fuzz target from the committed fixtures: safetensors files, the data.pkl of every
# torch.save archive, JSON batches. The batch, capture and contract targets start from nothing (their
# inputs are decisions, not files).
set -euo pipefail
target="$1"; fixtures="$2"; out="$3"
mkdir -p "$out"
case "$target" in
  safetensors) cp "$fixtures"/*.safetensors "$out"/ ;;
  json) cp "$fixtures"/*.json "$out"/ ;;
  pickle)
    python3 - "$fixtures" "$out" <<'PY'
import pathlib, sys, zipfile
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for p in sorted(src.glob("*.pt")):
    with zipfile.ZipFile(p) as z:
        for n in z.namelist():
            if n.endswith("/data.pkl"):
                (dst / (p.stem + ".pkl")).write_bytes(z.read(n))
PY
    ;;
  flight_recorder)  # real torch 2.15 Gloo dumps, pickle and JSON,
    for f in "$fixtures"/flight_recorder/*/fr_trace_rank_* "$fixtures"/flight_recorder/*/json/*.json; do
      rel="${f#"$fixtures"/flight_recorder/}"
      cp "$f" "$out/${rel//\//-}"
    done
    # and hostile ones (memo bombs and cycles, sequence gaps, claimed worlds, escapes, one memo'd
    # entry 20,000 times), written by tests/postmortem/hostile_dumps.py: hostile-<shape>-<file>
    python3 "$(dirname "$0")/../postmortem/hostile_dumps.py" --seeds "$out" ;;
  batch|capture|contract) ;;
esac
# Inputs that once found a bug (tests/fuzz/regressions/TARGET-*): every run starts from them.
here="$(dirname "$0")"
for f in "$here"/regressions/"$target"-*; do
  [ -e "$f" ] && cp "$f" "$out"/
done
true
