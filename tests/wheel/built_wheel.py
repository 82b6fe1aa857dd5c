"""What the wheel tests share: the wheel `make wheel` wrote into dist/, the bundled data they run it on, and the
environment a user's shell would give it (nothing of the build tree, no LOSSGUARD_ variable)."""
import glob
import os
import re
import sys
import zipfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DIST = os.environ.get("LOSSGUARD_WHEEL_DIR", os.path.join(ROOT, "dist"))
VENVS = os.environ.get("LOSSGUARD_VENV", os.path.expanduser("~/.cache/lossguard/venv"))
DATA = os.path.join(ROOT, "fixtures", "data")
CAPTURES = os.path.join(DATA, "captures", "mini-dp2-cp2")      # scripts/regen-fixtures.sh: a real DP2 x CP2 job
PLUGINS = ("liblossguard_torchzip.so", "liblossguard_trainer.so", "liblossguard_distributed.so")
# torch's own floor (its wheels are manylinux_2_28): wherever torch installs, lossguard does
GLIBC_FLOOR = (2, 28)
sys.path.insert(0, os.path.join(ROOT, "python"))
from lossguard_capture._version import __version__  # noqa: E402


def the_wheel():
    found = glob.glob(os.path.join(DIST, f"lossguard-{__version__}-py3-none-manylinux_*.whl"))
    assert len(found) == 1, f"expected one lossguard-{__version__} wheel in {DIST}, found {found}: run `make wheel`"
    return found[0]


def glibc_of_tags(filename):
    """The glibc versions the wheel's platform tags claim, e.g. [(2, 28)] for ...-manylinux_2_28_x86_64.whl."""
    return [(int(a), int(b)) for a, b in re.findall(r"manylinux_(\d+)_(\d+)_", os.path.basename(filename))]


def wheel_names():
    return zipfile.ZipFile(the_wheel()).namelist()


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOSSGUARD_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH="/usr/bin:/bin", OMP_NUM_THREADS="1", **extra)
    return env
