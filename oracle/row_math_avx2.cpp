// The oracle's row loops compiled for the avx2 instruction set (see CMakeLists.txt).
#define LOSSGUARD_ORACLE_ISA avx2
#include "oracle/row_math_body.h"
