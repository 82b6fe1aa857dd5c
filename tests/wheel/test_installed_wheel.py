"""The lossguard wheel (pyproject.toml; `make wheel` writes it into dist/), installed with pip into a fresh
virtual environment, nothing of the build tree on any path, run as a user runs it (issue #54):

* the wheel holds the executable (its scripts), the LibTorch plugins (its data: <env>/lib/lossguard/, each
  finding LibTorch in the environment's own torch, no path of the build machine) and lossguard_capture;
* the installed `lossguard` needs only glibc and the C++ runtime to start (scripts/check-needed.sh), and runs
  --version, count, inspect of a torch.save file (a plugin, through the environment's torch), postmortem of
  Flight Recorder dumps, audit of a capture — from a folder outside the repository, PATH without the env;
* lossguard_capture imported from the wheel finds that binary with no variable and the environment not
  activated; the Hugging Face example (examples/hf_trainer_audit.py, copied out of the repository) trains,
  records and audits step 0 with only the wheel installed beside transformers.

torch, safetensors and numpy (and transformers for the example) are not downloaded again: the fresh
environment reaches the base venv's (or the hf venv's) through a .pth file, and torch itself is linked into
its site-packages, where the plugins look for it. `make test` builds the wheel first; without one in dist/
the test fails, saying so.
"""
import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DIST = os.environ.get("LOSSGUARD_WHEEL_DIR", os.path.join(ROOT, "dist"))
VENVS = os.environ.get("LOSSGUARD_VENV", os.path.expanduser("~/.cache/lossguard/venv"))
sys.path.insert(0, os.path.join(ROOT, "python"))
from lossguard_capture._version import __version__  # noqa: E402

PY = f"python{sys.version_info[0]}.{sys.version_info[1]}"
PLUGINS = ("liblossguard_torchzip.so", "liblossguard_trainer.so", "liblossguard_distributed.so")


def the_wheel():
    found = glob.glob(os.path.join(DIST, f"lossguard-{__version__}-py3-none-manylinux_2_34_x86_64.whl"))
    assert len(found) == 1, f"expected one lossguard-{__version__} wheel in {DIST}, found {found}: run `make wheel`"
    return found[0]


def site_packages(prefix):
    return os.path.join(prefix, "lib", PY, "site-packages")


def fresh_env(where, *providers):
    """A new venv with the wheel alone installed (pip, no index, no dependencies), reaching the provider venvs'
    packages through a .pth file (a trainer venv layered over the base one names both) and the base venv's torch
    linked into its site-packages."""
    subprocess.run([sys.executable, "-m", "venv", where], check=True, capture_output=True)
    r = subprocess.run([os.path.join(where, "bin", "pip"), "install", "--no-index", "--no-deps", "-q", the_wheel()],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(os.path.join(site_packages(where), "zz-provider.pth"), "w") as f:
        f.write("".join(site_packages(p) + "\n" for p in (*providers, VENVS)))
    os.symlink(os.path.join(site_packages(VENVS), "torch"), os.path.join(site_packages(where), "torch"))
    return where


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOSSGUARD_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH="/usr/bin:/bin", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return fresh_env(str(tmp_path_factory.mktemp("wheel-env") / "env"))


def run(cmd, cwd, **kw):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=clean_env(), **kw)


def test_the_wheel_holds_the_binary_the_plugins_and_the_capture_package():
    names = zipfile.ZipFile(the_wheel()).namelist()
    data = f"lossguard-{__version__}.data"
    assert f"{data}/scripts/lossguard" in names, names
    for p in PLUGINS:
        assert f"{data}/data/lib/lossguard/{p}" in names, p
    assert "lossguard_capture/__init__.py" in names and "lossguard_capture/hf.py" in names


def test_installed_binary_needs_only_glibc_and_the_cxx_runtime(env):
    binary = os.path.join(env, "bin", "lossguard")
    r = subprocess.run([os.path.join(ROOT, "scripts", "check-needed.sh"), binary], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in PLUGINS:                     # each plugin finds LibTorch in the environment, not the build machine
        d = subprocess.run(["readelf", "-d", os.path.join(env, "lib", "lossguard", p)], capture_output=True,
                           text=True).stdout
        runpath = [line for line in d.splitlines() if "RUNPATH" in line or "RPATH" in line]
        assert runpath and all(f"$ORIGIN/../{PY}/site-packages/torch/lib" in line for line in runpath), runpath
        assert ROOT not in d and "/.cache/" not in d, runpath


def test_installed_binary_runs_every_cpu_command_from_outside_the_repository(env, tmp_path):
    lg = os.path.join(env, "bin", "lossguard")
    ex = os.path.join(ROOT, "fixtures", "data")
    r = run([lg, "--version"], tmp_path)
    assert r.returncode == 0 and f"lossguard {__version__}" in r.stdout and "NCCL:" in r.stdout, r.stdout + r.stderr
    r = run([lg, "count", os.path.join(ex, "gen_empty-responses.safetensors"), "--cp", "1,2"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    r = run([lg, "inspect", os.path.join(ex, "gen_random.pt")], tmp_path)            # the torch.save plugin
    assert r.returncode == 0, r.stdout + r.stderr
    fr = os.path.join(ex, "flight_recorder", "seed-pp1-broadcast")
    r = run([lg, "postmortem", fr, "--world", "4"], tmp_path)
    assert r.returncode == 3 and "ROOT" in r.stdout, r.stdout + r.stderr       # the hang explained: exit 3
    copy = shutil.copytree(fr, tmp_path / "fr")                      # the same from a copy outside the repo
    assert run([lg, "postmortem", str(copy), "--world", "4"], tmp_path).returncode == 3


def test_the_capture_package_from_the_wheel_finds_its_binary(env, tmp_path):
    code = ("import lossguard_capture as lc, os; print(os.path.realpath(lc.__file__)); "
            "print(lc.find_lossguard())")
    r = run([os.path.join(env, "bin", "python"), "-c", code], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    where, binary = r.stdout.split()
    assert where.startswith(os.path.realpath(site_packages(env))), where      # the wheel's copy, not the repo's
    assert binary == os.path.join(env, "bin", "lossguard"), binary


def test_the_hf_example_audits_with_only_the_wheel_installed(tmp_path):
    hf = f"{VENVS}-hf-5.25.0"
    if not os.path.isdir(hf):
        pytest.fail(f"{hf} is missing: scripts/setup-trainers.sh ci makes it")
    env = fresh_env(str(tmp_path / "env-hf"), hf)
    example = shutil.copy(os.path.join(ROOT, "examples", "hf_trainer_audit.py"), tmp_path / "hf_trainer_audit.py")
    r = run([os.path.join(env, "bin", "python"), str(example), "--out", str(tmp_path / "caps")], tmp_path)
    assert r.returncode == 0 and "step 0 audited: pass" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    r = run([os.path.join(env, "bin", "lossguard"), "audit", str(tmp_path / "caps" / "step000000")], tmp_path)
    assert r.returncode == 0 and "verdict: pass" in r.stdout, r.stdout + r.stderr
    r = run([os.path.join(env, "bin", "python"), str(example), "--out", str(tmp_path / "caps-bug"),
             "--no-loss-kwargs"], tmp_path)                                   # and it still fails the wrong one
    assert r.returncode == 1 and "stopped at step 0 by lossguard audit" in r.stdout, r.stdout[-3000:]
