#!/usr/bin/env bash
# Creates one virtual environment per real trainer the recorder's adapters are tested against
# (tests/trainers), each over the main venv's torch (scripts/setup.sh) so torch is not downloaded again:
# a .pth file in the trainer venv puts the main venv's site-packages on its sys.path, after its own, so
# pip sees torch (and numpy, safetensors, pytest) as installed and installs only what the trainer adds.
# The trainer packages are PINNED: an adapter hooks a trainer's internals (python/lossguard_capture/hf.py
# cites the functions), so a new version is adopted deliberately, by changing the pin and rerunning the
# tests.  Idempotent: a second run checks and returns in seconds.
#
#   scripts/setup.sh && scripts/setup-trainers.sh
#   ~/.cache/lossguard/venv-hf/bin/python -m pytest -q tests/trainers
set -euo pipefail

BASE="${LOSSGUARD_VENV:-$HOME/.cache/lossguard/venv}"
HF_VENV="${LOSSGUARD_HF_VENV:-$HOME/.cache/lossguard/venv-hf}"
# The newest releases pip could install when this was written (pip index versions transformers /
# accelerate): 5.25.0 is listed but requires kernels>=0.19.1,<0.20, which the index does not have, so
# 5.24.0 is the newest that resolves.  Keep in step with SUPPORTED in python/lossguard_capture/hf.py.
HF_PINS=(transformers==5.24.0 accelerate==1.16.0)

if ! "$BASE/bin/python" -c 'import torch, safetensors' 2>/dev/null; then
  echo "setup-trainers: $BASE has no torch; run scripts/setup.sh first" >&2
  exit 2
fi
base_site="$("$BASE/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

make_venv() {   # make_venv DIR: a venv of the base venv's Python whose sys.path ends with the base site-packages
  local dir="$1"
  if [ ! -x "$dir/bin/python" ]; then
    # the same interpreter as the base venv, so its compiled packages (torch) load
    "$BASE/bin/python" -c 'import sys, venv; venv.EnvBuilder(with_pip=True).create(sys.argv[1])' "$dir"
  fi
  local site
  site="$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$base_site" > "$site/_lossguard_base_venv.pth"
  # pip must treat torch as installed (found through the .pth), not fetch it again
  if ! "$dir/bin/python" -m pip show -q torch >/dev/null 2>&1; then
    echo "setup-trainers: pip in $dir does not see the base venv's torch" >&2
    exit 2
  fi
}

have_pins() {   # have_pins PYTHON PIN...: every pin installed at exactly that version
  local py="$1"; shift
  "$py" - "$@" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF
}

make_venv "$HF_VENV"
if ! have_pins "$HF_VENV/bin/python" "${HF_PINS[@]}"; then
  echo "setup-trainers: installing ${HF_PINS[*]} into $HF_VENV (torch from $BASE)" >&2
  "$HF_VENV/bin/python" -m pip install -q --disable-pip-version-check "${HF_PINS[@]}"
fi
# torch must still be the base venv's (a dependency resolution that pulled a second torch would
# mean gigabytes and a different build)
"$HF_VENV/bin/python" - "$base_site" <<'EOF'
import sys, torch, transformers, accelerate
assert torch.__file__.startswith(sys.argv[1]), f"torch comes from {torch.__file__}, not {sys.argv[1]}"
print(f"setup-trainers: venv-hf ready: transformers {transformers.__version__}, accelerate "
      f"{accelerate.__version__}, torch {torch.__version__} (shared)", file=sys.stderr)
EOF
