// The oracle's row loops compiled for the avx512 instruction set (see CMakeLists.txt).
#define LOSSGUARD_ORACLE_ISA avx512
// GCC 12 reports the `__Y` of its own intrinsic headers as maybe uninitialized where they build a
// vector from _mm*_undefined_* (a false positive of the inliner, GCC bug 105593): silenced for
// these intrinsics only, in this translation unit; the generic build of the same body has the
// warning on.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include "oracle/math/row_math_body.h"
