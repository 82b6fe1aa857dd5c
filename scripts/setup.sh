#!/usr/bin/env bash
# Installs what lossguard needs on a Debian machine, only what is missing: the build toolchain and
# C++ libraries from Debian, and the PyPI `torch` wheel (LibTorch, torchrun) in a virtual environment.
# Idempotent: a second run checks and returns in seconds.
set -euo pipefail

VENV="${LOSSGUARD_VENV:-$HOME/.cache/lossguard/venv}"
PYTHON="${LOSSGUARD_BASE_PYTHON:-python3}"
DEB_PACKAGES=(build-essential cmake ninja-build ccache pkg-config libcli11-dev nlohmann-json3-dev libgloo-dev
              libfmt-dev libgtest-dev python3-venv clang clang-format libclang-rt-14-dev procps time)

missing=()
for p in "${DEB_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# python3-venv is only needed when python3 is Debian's own; a pyenv or conda python brings venv.
if [ ${#missing[@]} -gt 0 ] && [ "${missing[*]}" = "python3-venv" ] && "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then
  missing=()
fi
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}" >&2
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! "$VENV/bin/python" -c 'import torch, numpy, safetensors, pytest' 2>/dev/null; then
  echo "setup: creating $VENV with torch, numpy, safetensors, pytest from PyPI (a few GiB, once)" >&2
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch numpy safetensors pytest
fi

# The Python lint and type check (scripts/check-python.sh, ctest python.lint), at pinned versions: a new
# release's new rules must not fail `make test` on code nobody touched. Bump them here, deliberately.
PY_CHECK_PINS=(ruff==0.17.6 mypy==2.4.1)
if ! "$VENV/bin/python" - "${PY_CHECK_PINS[@]}" 2>/dev/null <<'PYEOF'
import sys
from importlib.metadata import version
sys.exit(any(version(name) != want for name, want in (pin.split("==") for pin in sys.argv[1:])))
PYEOF
then
  echo "setup: installing ${PY_CHECK_PINS[*]} into $VENV" >&2
  "$VENV/bin/python" -m pip install -q "${PY_CHECK_PINS[@]}"
fi
