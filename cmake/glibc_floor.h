// Force-included into every translation unit of the portable build (cmake/portable.cmake).
// glibc 2.29 gave exp, exp2, log, log2 and pow new symbol versions (faster code, no SVID error
// handling); a binary linked against 2.29 or newer asks for GLIBC_2.29 and does not start on
// glibc 2.28 (RHEL 8, torch's manylinux_2_28 floor). Bind them to their first version, which every
// x86-64 glibc has; the results agree to the last bit except in errno handling, which lossguard
// does not read.
#pragma once
#if defined(__x86_64__) && defined(__linux__)
__asm__(".symver exp,exp@GLIBC_2.2.5");
__asm__(".symver exp2,exp2@GLIBC_2.2.5");
__asm__(".symver log,log@GLIBC_2.2.5");
__asm__(".symver log2,log2@GLIBC_2.2.5");
__asm__(".symver pow,pow@GLIBC_2.2.5");
#endif
