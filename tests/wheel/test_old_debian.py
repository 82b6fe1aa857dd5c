"""The wheel on an older Linux than the one that built it (issue #54): Debian 11 "bullseye" — glibc 2.31 and GCC 10's
libstdc++ (GLIBCXX_3.4.28), the oldest suite deb.debian.org still serves — made by scripts/sysroot.sh (debootstrap;
`make wheel` makes it, it is also the wheel's build sysroot) and entered by chroot, /proc mounted in a private mount
namespace (the binary finds its plugins from /proc/self/exe).

Inside that tree, with only its own packages:
* bullseye's own pip (20.3) installs the wheel into a fresh venv of bullseye's Python: it accepts the manylinux
  tag, so the tag is one an old installer understands (--ignore-requires-python: bullseye's Python is 3.9, older
  than lossguard_capture supports; the binary does not use Python);
* the installed binary runs --version, count, weights, topo, gen, inspect of safetensors, postmortem of Flight
  Recorder dumps and audit of the bundled captures of a real DP 2 x CP 2 job, against bullseye's glibc;
* the LibTorch plugins load in the same process as LibTorch over bullseye's libstdc++.so.6: inspect of a
  torch.save file and check run. torch's libraries are the base venv's (torch/lib and the nvidia/cu13/lib its
  RPATH names, hard-linked into the venv's site-packages as `pip install torch` would put them): the torch wheel's
  Python part is built for the base venv's CPython and cannot run on bullseye's 3.9, its libraries can (torch's
  wheels are manylinux_2_28 too).
"""
import os
import shutil
import subprocess
import sys

import pytest
from built_wheel import DATA, VENVS, __version__, the_wheel

TREE = os.environ.get("LOSSGUARD_SYSROOT", os.path.expanduser("~/.cache/lossguard/sysroot-bullseye"))
ENV = "/opt/lossguard-wheel-test"          # inside the tree
WORK = "/tmp/lossguard-wheel-test"         # inside the tree: the wheel and the data it runs on
PY = "python3.9"                           # bullseye's


def in_tree(*cmd, check=True):
    """Runs cmd inside the tree, with a clean environment, /proc of its own."""
    prefix = ["unshare", "--mount", "--pid", "--fork", f"--mount-proc={TREE}/proc"]
    if os.getuid() != 0:
        prefix.insert(1, "--map-root-user")
    env = ["/usr/bin/env", "-i", "PATH=/usr/bin:/bin", "HOME=/root", "OMP_NUM_THREADS=1", "LC_ALL=C.UTF-8"]
    r = subprocess.run([*prefix, "chroot", TREE, *env, *cmd], capture_output=True, text=True, timeout=300)
    if check:
        assert r.returncode == 0, f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    return r


def hard_link_tree(src, dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    r = subprocess.run(["cp", "-al", src, dst], capture_output=True, text=True)
    assert r.returncode == 0, f"cannot hard-link {src} into the tree (one filesystem needed): {r.stderr}"


@pytest.fixture(scope="module")
def lg():
    if not os.path.isfile(os.path.join(TREE, ".lossguard-sysroot")):
        pytest.fail(f"{TREE} is missing: scripts/sysroot.sh makes it (make wheel runs it)")
    for d in (ENV, WORK):
        shutil.rmtree(TREE + d, ignore_errors=True)
    shutil.copytree(DATA, TREE + WORK + "/data", ignore=shutil.ignore_patterns("expected*"))
    wheel = shutil.copy(the_wheel(), TREE + WORK)
    in_tree(f"/usr/bin/{PY}", "-m", "venv", ENV)
    in_tree(f"{ENV}/bin/pip", "install", "--no-index", "--no-deps", "--ignore-requires-python", "-q",
                WORK + "/" + os.path.basename(wheel))
    site = f"{TREE}{ENV}/lib/{PY}/site-packages"
    base = os.path.join(VENVS, "lib", f"python{sys.version_info[0]}.{sys.version_info[1]}", "site-packages")
    hard_link_tree(os.path.join(base, "torch", "lib"), os.path.join(site, "torch", "lib"))
    hard_link_tree(os.path.join(base, "nvidia", "cu13", "lib"), os.path.join(site, "nvidia", "cu13", "lib"))
    yield f"{ENV}/bin/lossguard"
    for d in (ENV, WORK):
        shutil.rmtree(TREE + d, ignore_errors=True)


def test_the_tree_is_older_than_torchs_floor_needs():
    libc = os.path.basename(os.path.realpath(os.path.join(TREE, "usr/lib/x86_64-linux-gnu/libc.so.6")))
    assert libc == "libc-2.31.so", libc
    with open(os.path.join(TREE, "usr/lib/x86_64-linux-gnu/libstdc++.so.6"), "rb") as f:
        runtime = f.read()                                     # the version strings of its symbol versions
    assert b"GLIBCXX_3.4.28" in runtime and b"GLIBCXX_3.4.29" not in runtime   # GCC 10's: the build's (12) is newer


def test_the_binary_runs_every_cpu_command_there(lg):
    r = in_tree(lg, "--version")
    assert f"lossguard {__version__}" in r.stdout, r.stdout
    d = WORK + "/data"
    # bug 1 of Relax PR #285: samples 1 and 4 have empty responses, counted 1 each at CP 1 by the legacy policy
    r = in_tree(lg, "count", f"{d}/gen_empty-responses.safetensors", "--cp", "1,2,4", "--policy", "legacy", check=False)
    assert r.returncode == 1 and "N(cp=1) = 11 but N(cp=2) = 9" in r.stdout, r.stdout + r.stderr
    in_tree(lg, "count", f"{d}/gen_empty-responses.safetensors", "--cp", "1,2,4")
    r = in_tree(lg, "inspect", f"{d}/torch_packed.safetensors")
    assert "safetensors" in r.stdout, r.stdout
    r = in_tree(lg, "weights", f"{d}/gen_random.safetensors", "--contract", "megatron-mean", "--dp", "2", check=False)
    assert r.returncode == 1 and "verdict: FAIL" in r.stdout, r.stdout + r.stderr
    r = in_tree(lg, "topo", "--tp", "2", "--pp", "2", "--dp", "2")   # Megatron's order: tp, cp, dp, pp
    assert "dp_cp  4 group(s) of 2: [0,2] [1,3] [4,6] [5,7]" in r.stdout, r.stdout
    in_tree(lg, "gen", "--case", "random", "--samples", "3", "--out", f"{WORK}/gen.safetensors")
    assert os.path.getsize(f"{TREE}{WORK}/gen.safetensors") > 0
    r = in_tree(lg, "postmortem", f"{d}/flight_recorder/seed-pp1-broadcast", "--world", "4", check=False)
    assert r.returncode == 3 and "ROOT" in r.stdout, r.stdout + r.stderr
    r = in_tree(lg, "audit", f"{d}/captures/mini-dp2-cp2/none")
    assert "verdict: pass" in r.stdout, r.stdout
    r = in_tree(lg, "audit", f"{d}/captures/mini-dp2-cp2/microbatch-mean", check=False)
    assert r.returncode == 1 and "weights   FAIL     per-CP-shard normalisation" in r.stdout, r.stdout + r.stderr


def test_the_libtorch_plugins_load_over_the_old_libstdcxx(lg):
    d = WORK + "/data"
    r = in_tree(lg, "inspect", f"{d}/gen_random.pt")                       # a torch.save file
    assert "tokens            int64          [36]" in r.stdout, r.stdout
    r = in_tree(lg, "check", f"{d}/gen_random.safetensors", "--cp", "1,2", "--impl", "torch")   # the trainer plugin
    assert "verdict: pass: the candidate matches the oracle" in r.stdout, r.stdout
