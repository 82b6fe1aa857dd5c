#!/usr/bin/env bash
# Fails unless FILE (an ELF binary) needs, at load time, only glibc and the C++ runtime: what the lossguard
# binary may assume on any Linux with glibc (issue #54; fmt, CLI11 and JSON are compiled in, NCCL, CUDA and
# LibTorch are loaded at run time by the commands that use them). Prints what it needs and, on failure, the
# libraries outside that set.
#
#     scripts/check-needed.sh build/cli/lossguard
set -euo pipefail
[[ $# -eq 1 && -f "$1" ]] || { sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
ALLOWED='^(libc\.so\.6|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|libgcc_s\.so\.1|libstdc\+\+\.so\.6|ld-linux-x86-64\.so\.2|ld-linux-aarch64\.so\.1)$'
needed="$(readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')"
echo "$1 needs: $(echo $needed)"
extra="$(grep -Ev "$ALLOWED" <<<"$needed" || true)"
if [[ -n "$extra" ]]; then
  echo "check-needed: $1 also needs $(echo $extra) at load time (allowed: glibc and the C++ runtime)" >&2
  exit 1
fi
