// Linked into the binary and the plugins of the portable build only (cmake/portable.cmake). GCC
// 12's libstdc++.a, linked in, reads two glibc symbols newer than the sysroot's glibc 2.31; each is
// defined here, hidden (visible to the objects it is linked with, never exported), with the meaning
// glibc gives it:
//   * __libc_single_threaded (glibc 2.32): nonzero lets libstdc++ skip atomics while the process
//   has one
//     thread. Always 0 here: the atomic path, correct with any number of threads;
//   * arc4random (glibc 2.36), for std::random_device("arc4random"): 32 random bits from getrandom
//   (2.25).
#include <sys/random.h>

#include <cstdint>

extern "C" {
__attribute__((visibility("hidden"))) char __libc_single_threaded = 0;

__attribute__((visibility("hidden"))) std::uint32_t arc4random(void) {
  std::uint32_t value = 0;
  while (getrandom(&value, sizeof value, 0) != static_cast<ssize_t>(sizeof value)) {
  }
  return value;
}
}
