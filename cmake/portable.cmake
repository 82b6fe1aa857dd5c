# The toolchain of the portable wheel (`make wheel`, issue #54): this machine's g++ over an old glibc, so the
# binary and its LibTorch plugins start on any Linux with glibc >= 2.28 (manylinux_2_28, torch's own floor),
# whatever the build machine's glibc and libstdc++ are.
#   * headers and libc.so.6 of the sysroot LOSSGUARD_SYSROOT (Debian 11, glibc 2.31: scripts/sysroot.sh), so
#     every glibc symbol is bound at the oldest version that tree has; cmake/glibc_floor.h pins the five libm
#     functions bullseye versions 2.29 (exp, exp2, log, log2, pow) at their first version;
#   * the C++ runtime linked in (-static-libstdc++): no GLIBCXX version asked of the machine; in a plugin its
#     symbols stay local (--exclude-libs), LibTorch keeps using the machine's libstdc++.so.6;
#   * cmake/glibc_floor.cpp defines, hidden, the two glibc symbols newer than the sysroot that GCC's
#     libstdc++.a reads (added to the binary and the plugins in CMakeLists.txt).
# Usage: cmake -DCMAKE_TOOLCHAIN_FILE=cmake/portable.cmake -DLOSSGUARD_SYSROOT=<tree> -DLOSSGUARD_DEPS_DIR=<.deps>
# (the C++ libraries' headers from scripts/pack-deps.sh: the sysroot has none of this machine's /usr/include).
set(LOSSGUARD_SYSROOT "$ENV{LOSSGUARD_SYSROOT}" CACHE PATH "Old glibc tree the portable build compiles against")
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES LOSSGUARD_SYSROOT)  # CMake's compiler checks read this file too
set(lossguard_sysroot_lib "${LOSSGUARD_SYSROOT}/usr/lib/x86_64-linux-gnu")
if(NOT EXISTS "${lossguard_sysroot_lib}/libc_nonshared.a")
  message(FATAL_ERROR "portable.cmake: LOSSGUARD_SYSROOT='${LOSSGUARD_SYSROOT}' has no glibc to link against: "
                      "make it with scripts/sysroot.sh")
endif()
# --sysroot on every compile and link line (CMAKE_SYSROOT alone leaves it off CMake's own link checks); the
# sysroot's start files and libraries before the ones g++ finds beside itself (this machine's). libgcc_s stays
# shared: one unwinder for LibTorch's exceptions and ours.
set(CMAKE_CXX_FLAGS_INIT "--sysroot=${LOSSGUARD_SYSROOT} -include ${CMAKE_CURRENT_LIST_DIR}/glibc_floor.h")
set(lossguard_portable_link "--sysroot=${LOSSGUARD_SYSROOT} -B${lossguard_sysroot_lib} -L${lossguard_sysroot_lib} -static-libstdc++")
set(CMAKE_EXE_LINKER_FLAGS_INIT "${lossguard_portable_link}")
set(CMAKE_SHARED_LINKER_FLAGS_INIT "${lossguard_portable_link} -Wl,--exclude-libs,libstdc++.a")
set(CMAKE_MODULE_LINKER_FLAGS_INIT "${lossguard_portable_link} -Wl,--exclude-libs,libstdc++.a")
set(CMAKE_CUDA_HOST_COMPILER g++)
set(CMAKE_CUDA_FLAGS_INIT "-Xcompiler=--sysroot=${LOSSGUARD_SYSROOT},-include,${CMAKE_CURRENT_LIST_DIR}/glibc_floor.h")
set(LOSSGUARD_PORTABLE ON)
