"""lossguard's sdist (scikit-build-core's build_sdist, what `pip install lossguard-<ver>.tar.gz` builds from on a
machine with the C++ dependencies and torch installed): it holds every file git tracks under the folders the wheel
is built from, nothing of a build tree, and CMake configures the unpacked copy as the wheel build does (every
source file of every target is checked to exist at generation). Compiling it is what `make wheel` does from the
checkout (the same CMakeLists.txt); the notes of issue #54 give a full build from the sdist.
"""
import os
import subprocess
import sys
import tarfile

from built_wheel import ROOT, VENVS, __version__

BUILT_FROM = ["CMakeLists.txt", "pyproject.toml", "cmake", "core", "oracle", "io", "kernels", "trainer",
              "distributed", "synth", "cli", "python/lossguard_capture"]


def build_sdist(where):
    code = "import sys; from scikit_build_core.build import build_sdist; print(build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(where)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return os.path.join(where, r.stdout.split()[-1])


def test_the_sdist_holds_the_sources_and_configures(tmp_path):
    sdist = build_sdist(tmp_path)
    assert os.path.basename(sdist) == f"lossguard-{__version__}.tar.gz", sdist
    top = f"lossguard-{__version__}/"
    with tarfile.open(sdist) as tar:
        names = {n[len(top):] for n in tar.getnames() if n.startswith(top)}
        tracked = subprocess.run(["git", "ls-files", *BUILT_FROM], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split()
        assert tracked, "git ls-files found nothing: run from a clone"
        missing = sorted(set(tracked) - names)
        assert not missing, f"the sdist lacks {missing[:10]}"
        assert not [n for n in names if n.startswith(("build", "dist/", ".deps"))], "a build tree in the sdist"
        tar.extractall(tmp_path, filter="data")
    r = subprocess.run(["cmake", "-S", str(tmp_path / top), "-B", str(tmp_path / "configured"), "-G", "Ninja",
                        "-DLOSSGUARD_BUILD_TESTS=OFF", f"-DLOSSGUARD_PYTHON={VENVS}/bin/python"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "Build files have been written" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "configured" / "build.ninja") as f:
        ninja = f.read()
    for target in ("cli/lossguard", "lib/liblossguard_torchzip.so", "lib/liblossguard_trainer.so"):
        assert f"build {target}:" in ninja, target
