// The fused cross entropy's row kernels compiled for the generic instruction set (see
// CMakeLists.txt).
#define LOSSGUARD_XENT_ISA generic
#include "kernels/cpu/fused_xent_body.h"
