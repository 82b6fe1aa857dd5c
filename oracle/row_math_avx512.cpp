// The oracle's row loops compiled for the avx512 instruction set (see CMakeLists.txt).
#define LOSSGUARD_ORACLE_ISA avx512
#include "oracle/row_math_body.h"
