// The fused cross entropy's row kernels compiled for the avx2 instruction set (see CMakeLists.txt).
#define LOSSGUARD_XENT_ISA avx2
#include "kernels/cpu/fused_xent_body.h"
