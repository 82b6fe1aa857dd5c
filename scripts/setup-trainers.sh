#!/usr/bin/env bash
# Creates one virtual environment per real trainer the recorder's adapters are tested against
# (tests/trainers), each over the main venv's torch (scripts/setup.sh) so torch is not downloaded again:
# a .pth file in the trainer venv puts the main venv's site-packages on its sys.path, after its own, so
# pip sees torch (and numpy, safetensors, pytest) as installed and installs only what the trainer adds.
# The trainer packages are PINNED: an adapter hooks a trainer's internals (python/lossguard_capture/hf.py
# and trl.py cite the functions), so a new version is adopted deliberately, by changing the pin and
# rerunning the tests.  Idempotent: a second run checks and returns in seconds.
#
# Beside each trainer's pinned venv, one venv per other supported release (issue #42: each adapter runs
# on several releases, python/lossguard_capture/*.py SPEC.verified), named venv-<trainer>-<version>:
#
#   scripts/setup.sh && scripts/setup-trainers.sh            # `ci`: the pins and the oldest and newest
#                                                              # supported release of each trainer (make test)
#   scripts/setup-trainers.sh all                              # every supported release (make gallery)
#   scripts/setup-trainers.sh hf megatron verl                 # only the named ones (`make demo`: the pins)
#   scripts/setup-trainers.sh hf-5.19.0 verl-0.8.0             # one release venv each
#   ~/.cache/lossguard/venv-hf/bin/python -m pytest -q tests/trainers/test_hf_trainer.py
#   ~/.cache/lossguard/venv-hf/bin/python -m pytest -q tests/trainers/test_trl_trainer.py
#   ~/.cache/lossguard/venv-megatron/bin/python -m pytest -q tests/trainers/test_megatron.py
#   ~/.cache/lossguard/venv-verl/bin/python -m pytest -q tests/trainers/test_verl.py
set -euo pipefail

BASE="${LOSSGUARD_VENV:-$HOME/.cache/lossguard/venv}"
HF_VENV="${LOSSGUARD_HF_VENV:-$BASE-hf}"  # beside the base venv (tests/CMakeLists.txt looks there)
# The demo's and TRL's transformers pin (5.24.0, the newest that resolved when it was adopted; 5.25.0, which
# needs kernels 0.19.1, resolves since and has a release venv of its own below, hf-5.25.0).  Keep the
# release venvs in step with SPEC.verified in python/lossguard_capture/hf.py.
# TRL (python/lossguard_capture/trl.py SUPPORTED) shares this venv: 1.16.0 is the newest release pip lists
# (pip index versions trl) and requires transformers>=4.56.2, so it resolves over the 5.24.0 pin (it adds
# datasets, pandas, pyarrow; nothing already installed changes).
HF_PINS=(transformers==5.24.0 accelerate==1.16.0 trl==1.16.0)
MEGATRON_VENV="${LOSSGUARD_MEGATRON_VENV:-$BASE-megatron}"
# The newest megatron-core pip lists (pip index versions megatron-core); its own requirements are torch,
# numpy and packaging only (no Transformer Engine, no apex: the tests run its CPU paths).  Keep in step
# with SUPPORTED in python/lossguard_capture/megatron.py.
MEGATRON_PINS=(megatron-core==0.16.1)
VERL_VENV="${LOSSGUARD_VERL_VENV:-$BASE-verl}"
# verl 0.9.1 is the newest release on the index (pip index versions verl).  Its own requirements add
# wandb, tensorboard, torchdata, pybind11, pylatexenc ..., which the actor's loss path never imports (and
# torchdata could bring another torch), so verl is installed --no-deps, together with what importing
# verl.workers.utils.losses and verl.workers.engine.fsdp.transformer_impl needs, pinned: ray (verl/protocol.py
# imports it when verl is imported), tensordict (verl requires >=0.8,<=0.10.0), transformers (verl requires
# >=5.5.3,<5.11, !=5.6.0: 5.10.4 is the newest), and the packages its modules import at the top.  Keep
# VERL_PIN in step with SUPPORTED in python/lossguard_capture/verl.py.
VERL_PIN=verl==0.9.1
VERL_DEPS=(ray==2.60.0 tensordict==0.10.0 transformers==5.10.4 accelerate==1.16.0 peft==0.21.2 datasets==5.2.0
           hydra-core==1.3.2 omegaconf==2.3.0 codetiming==1.4.0 pillow==13.0.0)

# The other supported releases, each verified by the trainer's test file (the venv's pins after the name).
# hf-X: transformers X beside the TRL pin; trl-Y: TRL Y over the transformers pin (trl 1.13 imports requests
# without declaring it); verl-Z: verl Z --no-deps over VERL_DEPS; megatron-W: megatron-core W (0.15 pins
# numpy<2, which pip installs into that venv only; torch stays the base venv's).
RELEASES=(hf-5.19.0 hf-5.20.2 hf-5.21.1 hf-5.22.2 hf-5.23.0 hf-5.25.0 trl-1.13.0 trl-1.14.2
          verl-0.8.0 verl-0.9.0 megatron-0.15.3 megatron-0.16.0)
# make test: the pins plus the oldest and the newest supported release of each trainer where the pin is not it
CI=(hf megatron verl hf-5.19.0 hf-5.25.0 trl-1.13.0 verl-0.8.0 megatron-0.15.3)
release_pins() {   # release_pins NAME: the pip requirements of release venv NAME (one per line)
  local trainer="${1%%-*}" version="${1#*-}"
  case "$trainer" in
    hf) printf '%s\n' "transformers==$version" accelerate==1.16.0 trl==1.16.0 ;;
    trl) printf '%s\n' "trl==$version" transformers==5.24.0 accelerate==1.16.0
         if [[ "$version" == 1.13.* ]]; then printf '%s\n' requests==2.34.2; fi ;;
    megatron) printf '%s\n' "megatron-core==$version" ;;
    verl) printf '%s\n' "${VERL_DEPS[@]}" ;;
  esac
}

WANT=("${@:-ci}")
WANT=(${WANT[*]})
EXPANDED=()
for w in "${WANT[@]}"; do
  case "$w" in
    ci) EXPANDED+=("${CI[@]}") ;;
    all) EXPANDED+=(hf megatron verl "${RELEASES[@]}") ;;
    hf|megatron|verl) EXPANDED+=("$w") ;;
    *) if [[ " ${RELEASES[*]} " == *" $w "* ]]; then EXPANDED+=("$w"); else
         echo "setup-trainers: unknown venv '$w' (ci, all, hf, megatron, verl, or one of: ${RELEASES[*]})" >&2; exit 2
       fi ;;
  esac
done
WANT=("${EXPANDED[@]}")
wants() { [[ " ${WANT[*]} " == *" $1 "* ]]; }

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

if wants hf; then
make_venv "$HF_VENV"
if ! have_pins "$HF_VENV/bin/python" "${HF_PINS[@]}"; then
  echo "setup-trainers: installing ${HF_PINS[*]} into $HF_VENV (torch from $BASE)" >&2
  "$HF_VENV/bin/python" -m pip install -q --disable-pip-version-check "${HF_PINS[@]}"
fi
# torch must still be the base venv's (a dependency resolution that pulled a second torch would
# mean gigabytes and a different build)
"$HF_VENV/bin/python" - "$base_site" <<'EOF'
import sys, torch, transformers, accelerate, trl
assert torch.__file__.startswith(sys.argv[1]), f"torch comes from {torch.__file__}, not {sys.argv[1]}"
print(f"setup-trainers: venv-hf ready: transformers {transformers.__version__}, accelerate "
      f"{accelerate.__version__}, trl {trl.__version__}, torch {torch.__version__} (shared)", file=sys.stderr)
EOF
fi

if wants megatron; then
make_venv "$MEGATRON_VENV"
if ! have_pins "$MEGATRON_VENV/bin/python" "${MEGATRON_PINS[@]}"; then
  echo "setup-trainers: installing ${MEGATRON_PINS[*]} into $MEGATRON_VENV (torch from $BASE)" >&2
  "$MEGATRON_VENV/bin/python" -m pip install -q --disable-pip-version-check "${MEGATRON_PINS[@]}"
fi
"$MEGATRON_VENV/bin/python" - "$base_site" <<'EOF'
import sys, torch
from importlib.metadata import version
assert torch.__file__.startswith(sys.argv[1]), f"torch comes from {torch.__file__}, not {sys.argv[1]}"
import megatron.core.parallel_state  # noqa: F401  (imports without Transformer Engine / apex)
print(f"setup-trainers: venv-megatron ready: megatron-core {version('megatron-core')}, torch {torch.__version__} "
      f"(shared)", file=sys.stderr)
EOF
fi

if wants verl; then
make_venv "$VERL_VENV"
if ! have_pins "$VERL_VENV/bin/python" "$VERL_PIN" "${VERL_DEPS[@]}"; then
  echo "setup-trainers: installing $VERL_PIN (--no-deps) and ${VERL_DEPS[*]} into $VERL_VENV (torch from $BASE)" >&2
  "$VERL_VENV/bin/python" -m pip install -q --disable-pip-version-check "${VERL_DEPS[@]}"
  "$VERL_VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$VERL_PIN"
fi
"$VERL_VENV/bin/python" - "$base_site" <<'EOF'
import os, sys, warnings
os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")
warnings.simplefilter("ignore")
import torch, verl, transformers
import verl.workers.utils.losses                                    # the loss path lossguard_capture.verl hooks
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine    # noqa: F401 - the engine tests/trainers drives
assert torch.__file__.startswith(sys.argv[1]), f"torch comes from {torch.__file__}, not {sys.argv[1]}"
print(f"setup-trainers: venv-verl ready: verl {verl.__version__}, transformers {transformers.__version__}, "
      f"torch {torch.__version__} (shared)", file=sys.stderr)
EOF
fi

# The release venvs: the same construction, the release's pins, then the installed version checked.
for name in "${RELEASES[@]}"; do
  wants "$name" || continue
  dir="$BASE-$name"
  trainer="${name%%-*}" version="${name#*-}"
  mapfile -t pins < <(release_pins "$name")
  package="$trainer"
  case "$trainer" in hf) package=transformers ;; megatron) package=megatron-core ;; esac
  make_venv "$dir"
  if ! have_pins "$dir/bin/python" "${pins[@]}" "$package==$version"; then
    echo "setup-trainers: installing ${pins[*]} into $dir (torch from $BASE)" >&2
    "$dir/bin/python" -m pip install -q --disable-pip-version-check "${pins[@]}"
    if [ "$trainer" = verl ]; then
      "$dir/bin/python" -m pip install -q --disable-pip-version-check --no-deps "verl==$version"
    fi
  fi
  "$dir/bin/python" - "$base_site" "$package" "$version" "$name" <<'EOF'
import sys, torch
from importlib.metadata import version
base, package, want, name = sys.argv[1:]
assert torch.__file__.startswith(base), f"torch comes from {torch.__file__}, not {base}"
assert version(package) == want, f"{package} {version(package)} installed, {want} wanted"
print(f"setup-trainers: venv-{name} ready: {package} {want}, torch {torch.__version__} (shared)", file=sys.stderr)
EOF
done
