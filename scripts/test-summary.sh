#!/usr/bin/env bash
# The end of `make test`: what ran, what was skipped and why, and what is absent. Fails (exit 1)
# when a test group this machine can run is missing, so a quietly shrinking suite cannot pass.
# Usage: scripts/test-summary.sh BUILD_DIR FUZZ_BUILD_DIR
set -uo pipefail
build=$1; fuzz=$2; status=0
count() { (cd "$1" && ctest -N -L "$2" 2>/dev/null | sed -n 's/^Total Tests: //p'); }
echo
echo "== test summary =="
for label in cpu torch multiproc cuda; do
  printf '  %-9s %4s tests registered\n' "$label" "$(count "$build" "$label")"
done
printf '  %-9s %4s tests registered (clang, ASan + UBSan)\n' "sanitized" "$(count "$fuzz" .)"
# Tests that did not run (gtest skips, e.g. the CUDA tests on a machine without a GPU), from the
# ctest output `make test` keeps, and the reason each gives.
log="$build/ctest-output.log"
if [ -f "$log" ]; then
  skipped=$(grep -c '(Skipped)$' "$log" || true)
  echo "  skipped:  $skipped test(s)"
  grep '(Skipped)$' "$log" | sed 's/^[[:space:]]*/    /' | head -10
  if [ -x "$build/tests/kernels_cuda_test" ] && grep -q 'Cuda.*(Skipped)$' "$log"; then
    reason=$("$build/tests/kernels_cuda_test" 2>&1 | grep -m1 -o 'no CUDA device.*')
    [ -n "$reason" ] && echo "    reason: $reason"
  fi
fi
# Groups this machine can run must be there.
if [ -e /usr/include/gloo/algorithm.h ] && [ "$(count "$build" multiproc)" = "0" ]; then
  echo "  ABSENT: multi-process (Gloo) tests, although the Gloo headers are installed"; status=1
fi
if command -v clang++ >/dev/null && [ "$(count "$fuzz" .)" = "0" ]; then
  echo "  ABSENT: sanitizer and fuzz tests, although clang is installed"; status=1
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "  not run here: CUDA kernels and NCCL replay (no GPU; scripts/gpu-check runs them on one)"
fi
[ $status -eq 0 ] && echo "  every test group this machine can run is present"
exit $status
