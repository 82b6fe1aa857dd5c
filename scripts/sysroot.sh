#!/usr/bin/env bash
# Makes the old Debian tree the portable wheel is built against and tested on (issue #54): Debian 11
# "bullseye" (glibc 2.31, libstdc++ of GCC 10), the oldest suite deb.debian.org still serves (buster's
# dists/ answer 404), by debootstrap, with glibc's headers and its Python. Two uses:
#   * the sysroot of `make wheel` (cmake/portable.cmake): this machine's g++ compiles against bullseye's
#     glibc headers and links against its libc.so.6, so the binary and plugins ask only for symbol versions
#     an old glibc has (cmake/glibc_floor.h pins the few libm ones bullseye itself made newer than 2.28);
#   * the older Debian the installed wheel is run on (tests/wheel/test_old_debian.py, by chroot).
# Idempotent (a stamp file records what was made); about a minute and 300 MiB the first time. Needs root
# (or sudo) for debootstrap and the chroot, as scripts/setup.sh does for apt-get.
#   scripts/sysroot.sh [FOLDER]    (default $LOSSGUARD_SYSROOT, else ~/.cache/lossguard/sysroot-bullseye)
set -euo pipefail
SUITE=bullseye
MIRROR="${LOSSGUARD_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES=libc6-dev,linux-libc-dev,python3,python3-venv
out="${1:-${LOSSGUARD_SYSROOT:-$HOME/.cache/lossguard/sysroot-$SUITE}}"
gcc_major="$(g++ -dumpversion | cut -d. -f1)"
stamp="$out/.lossguard-sysroot"
want="$SUITE $PACKAGES g++-$gcc_major"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ! command -v debootstrap >/dev/null && [ ! -x /usr/sbin/debootstrap ]; then
  echo "sysroot: installing debootstrap" >&2
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends debootstrap
fi
echo "sysroot: debootstrap $SUITE ($PACKAGES) into $out (about a minute, once)" >&2
$SUDO rm -rf "$out"
mkdir -p "$(dirname "$out")"
log="$(mktemp)"
if ! $SUDO /usr/sbin/debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$out" "$MIRROR" >"$log" 2>&1; then
  tail -20 "$log" >&2
  echo "sysroot: debootstrap $SUITE from $MIRROR failed (log above)" >&2
  exit 1
fi
rm -f "$log"
$SUDO chown -R "$(id -u):$(id -g)" "$out/usr/lib" "$out/usr/include" "$out/usr/lib64" "$out/opt" "$out/tmp"
# As a sysroot: the linker reads the tree's absolute symlinks (usr/lib64/ld-linux-x86-64.so.2 ->
# /lib/...) against this machine's root, so make each one relative.
while IFS= read -r link; do
  target="$(readlink "$link")"
  case "$target" in
    /*) ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$out$target")" "$link" ;;
  esac
done < <(find "$out/usr/lib" "$out/usr/lib64" -type l)
# This machine's g++ looks for its own C++ headers inside the sysroot: point there at them.
mkdir -p "$out/usr/include/c++" "$out/usr/include/x86_64-linux-gnu/c++"
ln -sfn "/usr/include/c++/$gcc_major" "$out/usr/include/c++/$gcc_major"
ln -sfn "/usr/include/x86_64-linux-gnu/c++/$gcc_major" "$out/usr/include/x86_64-linux-gnu/c++/$gcc_major"
echo "$want" >"$stamp"
echo "sysroot: $out ready ($(basename "$(readlink -f "$out/usr/lib/x86_64-linux-gnu/libc.so.6")"))" >&2
