// The fused cross entropy's row kernels compiled for the avx512 instruction set (see
// CMakeLists.txt).
#define LOSSGUARD_XENT_ISA avx512
#include "kernels/cpu/fused_xent_body.h"
