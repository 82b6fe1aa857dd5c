"""The lossguard wheel (pyproject.toml; `make wheel` writes it into dist/), installed with pip into a fresh
virtual environment, nothing of the build tree on any path, run as a user runs it (issue #54):

* the wheel holds the executable (its scripts), the LibTorch plugins (its data: <env>/lib/lossguard/, each
  finding LibTorch in the environment's own torch, no path of the build machine) and lossguard_capture;
* auditwheel finds no symbol newer than glibc 2.28 (torch's own floor) and the file name claims no older one;
* the installed `lossguard` needs only glibc and the C++ runtime to start (scripts/check-needed.sh), and runs
  --version, count, inspect of a torch.save file (a plugin, through the environment's torch), postmortem of
  Flight Recorder dumps, audit of the bundled captures of a real DP 2 x CP 2 job (one passes, one fails) — from
  a folder outside the repository, PATH without the env;
* lossguard_capture imported from the wheel finds that binary with no variable and the environment not
  activated; the Hugging Face example (examples/hf_trainer_audit.py, copied out of the repository) trains,
  records and audits step 0 with only the wheel installed beside transformers.

torch, safetensors and numpy (and transformers for the example) are not downloaded again: the fresh
environment reaches the base venv's (or the hf venv's) through a .pth file, and torch itself is linked into
its site-packages, where the plugins look for it. `make test` builds the wheel first; without one in dist/
the test fails, saying so.
"""
import os
import re
import shutil
import subprocess
import sys

import pytest
from built_wheel import (
    CAPTURES,
    DATA,
    GLIBC_FLOOR,
    PLUGINS,
    ROOT,
    VENVS,
    __version__,
    clean_env,
    glibc_of_tags,
    the_wheel,
    wheel_names,
)

PY = f"python{sys.version_info[0]}.{sys.version_info[1]}"


def site_packages(prefix):
    return os.path.join(prefix, "lib", PY, "site-packages")


def wheel_only_env(where):
    """A new venv with the wheel alone installed (pip, no index, no dependencies)."""
    subprocess.run([sys.executable, "-m", "venv", where], check=True, capture_output=True)
    r = subprocess.run([os.path.join(where, "bin", "pip"), "install", "--no-index", "--no-deps", "-q", the_wheel()],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return where


def fresh_env(where, *providers):
    """wheel_only_env reaching the provider venvs' packages through a .pth file (a trainer venv layered over the
    base one names both) and the base venv's torch linked into its site-packages."""
    wheel_only_env(where)
    with open(os.path.join(site_packages(where), "zz-provider.pth"), "w") as f:
        f.write("".join(site_packages(p) + "\n" for p in (*providers, VENVS)))
    os.symlink(os.path.join(site_packages(VENVS), "torch"), os.path.join(site_packages(where), "torch"))
    return where


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return fresh_env(str(tmp_path_factory.mktemp("wheel-env") / "env"))


def run(cmd, cwd, **kw):
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=clean_env(), **kw)


def test_the_wheel_holds_the_binary_the_plugins_and_the_capture_package():
    names = wheel_names()
    data = f"lossguard-{__version__}.data"
    assert f"{data}/scripts/lossguard" in names, names
    for p in PLUGINS:
        assert f"{data}/data/lib/lossguard/{p}" in names, p
    assert "lossguard_capture/__init__.py" in names and "lossguard_capture/hf.py" in names


def test_auditwheel_states_the_tag_honestly():
    """auditwheel reads every symbol version the binary and plugins ask for: the oldest glibc they allow is at most
    torch's floor (2.28), and the file name claims no glibc older than that. (Its first line says linux_x86_64:
    the plugins need LibTorch, which the wheel leaves to the environment's torch.)"""
    r = subprocess.run([sys.executable, "-m", "auditwheel", "show", the_wheel()], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = " ".join(r.stdout.split())
    m = re.search(r'constrains the platform tag to "manylinux_(\d+)_(\d+)_x86_64"', text)
    assert m, text
    allowed = (int(m.group(1)), int(m.group(2)))
    assert allowed <= GLIBC_FLOOR, f"the wheel needs glibc {allowed}, newer than {GLIBC_FLOOR}: {text}"
    claimed = glibc_of_tags(the_wheel())
    assert claimed and all(allowed <= c for c in claimed), (claimed, allowed)


def test_installed_binary_needs_only_glibc_and_the_cxx_runtime(env):
    binary = os.path.join(env, "bin", "lossguard")
    r = subprocess.run([os.path.join(ROOT, "scripts", "check-needed.sh"), binary], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "libstdc++" not in r.stdout, r.stdout                     # the C++ runtime is linked in
    for p in PLUGINS:                     # each plugin finds LibTorch in the environment, not the build machine
        d = subprocess.run(["readelf", "-d", os.path.join(env, "lib", "lossguard", p)], capture_output=True,
                           text=True).stdout
        runpath = [line for line in d.splitlines() if "RUNPATH" in line or "RPATH" in line]
        # the environment's torch, whichever CPython 3 the environment has
        assert runpath and all(f"$ORIGIN/../{PY}/site-packages/torch/lib" in line for line in runpath), runpath
        assert all("$ORIGIN/../python3.10/site-packages/torch/lib" in line for line in runpath), runpath
        assert ROOT not in d and "/.cache/" not in d, runpath


def test_installed_binary_runs_every_cpu_command_from_outside_the_repository(env, tmp_path):
    lg = os.path.join(env, "bin", "lossguard")
    ex = DATA
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
    r = run([lg, "audit", os.path.join(CAPTURES, "none")], tmp_path)      # a real DP2 x CP2 job's capture
    assert r.returncode == 0 and "verdict: pass" in r.stdout, r.stdout + r.stderr
    r = run([lg, "audit", os.path.join(CAPTURES, "microbatch-mean")], tmp_path)
    assert r.returncode == 1 and "weights   FAIL     per-CP-shard normalisation" in r.stdout, r.stdout + r.stderr


def test_a_plugin_without_its_torch_says_which_torch_it_needs(tmp_path):
    """The plugins load LibTorch from the environment's torch: with none there, or another release, `check` (the
    trainer plugin) fails naming the torch the plugins were built with and what the environment has — the
    installed binary never falls back to the build machine's plugins; a safetensors file still reads (no
    plugin)."""
    env = wheel_only_env(str(tmp_path / "env"))
    lg = os.path.join(env, "bin", "lossguard")
    built = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True, check=True).stdout.strip()
    built_minor = ".".join(built.split(".")[:2])
    check = [lg, "check", os.path.join(DATA, "gen_random.safetensors"), "--cp", "1,2", "--impl", "torch"]
    r = run(check, tmp_path)                                     # the LibTorch trainer plugin
    assert r.returncode != 0 and "no torch in" in r.stderr and f"torch=={built_minor}.*" in r.stderr, r.stderr
    assert run([lg, "inspect", os.path.join(DATA, "gen_random.safetensors")], tmp_path).returncode == 0
    torch_dir = os.path.join(site_packages(env), "torch")
    os.makedirs(torch_dir)
    with open(os.path.join(torch_dir, "version.py"), "w") as f:          # another release, as torch writes it
        f.write("from typing import Optional\n\n__all__ = ['__version__']\n__version__ = '2.3.1+cpu'\n")
    r = run(check, tmp_path)
    assert r.returncode != 0, r.stdout
    assert f"built against torch {built}" in r.stderr and "this environment has torch 2.3.1+cpu" in r.stderr, r.stderr


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
