#!/usr/bin/env bash
# End-to-end runs of the real binary: version, gen in every format, inspect, exit codes, and torch.load
# (the real consumer) reading what `gen` wrote.
set -euo pipefail
LG="$1"; PY="$2"
dir=$(mktemp -d); trap 'rm -rf "$dir"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$LG" --version | grep -q '^lossguard ' || fail "--version"
for ext in safetensors pt json; do
  "$LG" gen --case empty-responses --samples 6 --vocab 7 --out "$dir/b.$ext" >/dev/null
  "$LG" inspect "$dir/b.$ext" --json "$dir/i.$ext.json" >/dev/null
done
"$PY" - "$dir" <<'PY'
import json, sys, torch, safetensors.torch
d = sys.argv[1]
pt = torch.load(f"{d}/b.pt")                 # weights_only: the archive holds only tensors and scalars
st = safetensors.torch.load_file(f"{d}/b.safetensors")
for k in ("tokens", "total_lengths", "response_lengths", "loss_masks", "logits"):
    assert torch.equal(pt[k], st[k]), k
reports = [json.load(open(f"{d}/i.{e}.json")) for e in ("safetensors", "pt", "json")]
assert all(r["verdict"] == "pass" for r in reports)
strip = lambda r: [{k: v for k, v in s.items() if k != "file"} for s in r["samples"]]
assert strip(reports[0]) == strip(reports[1]) == strip(reports[2])
assert int(pt["response_lengths"].eq(0).sum()) > 0
PY
set +e
"$LG" inspect "$dir/does-not-exist.pt" 2>/dev/null; [ $? -eq 2 ] || fail "missing file must exit 2"
"$LG" 2>/dev/null >/dev/null; [ $? -eq 2 ] || fail "no subcommand must exit 2"
echo '{"samples": []}' > "$dir/empty.json"
"$LG" inspect "$dir/empty.json" >/dev/null 2>&1; [ $? -eq 4 ] || fail "no samples must exit 4"
fr="$(dirname "$0")/../../fixtures/data/flight_recorder/seed-pp1-broadcast"
"$LG" postmortem "$fr" --json "$dir/pm.json" >/dev/null; [ $? -eq 3 ] || fail "postmortem of a hang must exit 3"
grep -q '"protocol": "pr285-always-broadcast"' "$dir/pm.json" || fail "postmortem must name the seed's bug"
echo "e2e: ok"
