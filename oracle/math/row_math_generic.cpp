// The oracle's row loops compiled for the generic instruction set (see CMakeLists.txt).
#define LOSSGUARD_ORACLE_ISA generic
#include "oracle/math/row_math_body.h"
