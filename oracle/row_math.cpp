// Picks the oracle's row loops for the best instruction set this CPU has (row_math.h).
#include "oracle/row_math.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace lossguard::oracle {

#define LOSSGUARD_ROW_MATH_DECLARE(isa)                                                        \
  namespace isa {                                                                              \
  RowStats logits_row_stats(const void* z, DType dtype, int64_t v);                            \
  RowComparison compare_logits_row(const void* z, const void* got, DType dtype, int64_t begin, \
                                   int64_t end, double c, double lse,                          \
                                   const ElementBoundRow* bounds, int num_bounds);             \
  RowComparison compare_zero_row(const double* got, int64_t n, double tol, int64_t* nonzero);  \
  void row_to_f64(const void* src, DType dtype, int64_t n, double* out);                       \
  bool row_is_zero(const void* src, DType dtype, int64_t n);                                   \
  }
LOSSGUARD_ROW_MATH_DECLARE(generic)
#if defined(__x86_64__) && defined(LOSSGUARD_ORACLE_X86)
LOSSGUARD_ROW_MATH_DECLARE(avx2)
LOSSGUARD_ROW_MATH_DECLARE(avx512)
#endif

namespace {

struct RowMath {
  const char* name;
  RowStats (*stats)(const void*, DType, int64_t);
  RowComparison (*compare)(const void*, const void*, DType, int64_t, int64_t, double, double,
                           const ElementBoundRow*, int);
  RowComparison (*zero)(const double*, int64_t, double, int64_t*);
  void (*to_f64)(const void*, DType, int64_t, double*);
  bool (*is_zero)(const void*, DType, int64_t);
};

#define LOSSGUARD_ROW_MATH_TABLE(isa)                                                          \
  RowMath {                                                                                    \
    #isa, isa::logits_row_stats, isa::compare_logits_row, isa::compare_zero_row,               \
        isa::row_to_f64, isa::row_is_zero                                                      \
  }

RowMath pick() {
#if defined(__x86_64__) && defined(LOSSGUARD_ORACLE_X86)
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  if (v4) return LOSSGUARD_ROW_MATH_TABLE(avx512);
  if (v3) return LOSSGUARD_ROW_MATH_TABLE(avx2);
#endif
  return LOSSGUARD_ROW_MATH_TABLE(generic);
}

const RowMath& row_math() {
  static const RowMath chosen = pick();
  return chosen;
}

}  // namespace

RowStats logits_row_stats(const void* z, DType dtype, int64_t v) {
  return row_math().stats(z, dtype, v);
}

RowComparison compare_logits_row(const void* z, const void* got, DType dtype, int64_t begin,
                                 int64_t end, double c, double lse, const ElementBoundRow* bounds,
                                 int num_bounds) {
  return row_math().compare(z, got, dtype, begin, end, c, lse, bounds, num_bounds);
}

RowComparison compare_zero_row(const double* got, int64_t n, double tol, int64_t* nonzero) {
  return row_math().zero(got, n, tol, nonzero);
}

void row_to_f64(const void* src, DType dtype, int64_t n, double* out) {
  row_math().to_f64(src, dtype, n, out);
}

bool row_is_zero(const void* src, DType dtype, int64_t n) {
  return row_math().is_zero(src, dtype, n);
}

const char* row_math_isa() { return row_math().name; }

namespace {

std::vector<double> make_exp_table(DType dtype) {
  std::vector<double> t(65536);
  HostArray one;
  one.dtype = dtype;
  one.shape = {1};
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const auto b16 = static_cast<uint16_t>(bits);
    one.data = reinterpret_cast<const std::byte*>(&b16);
    const double x = one.get_f64(0);
    t[bits] = std::isfinite(x) && std::fabs(x) <= 700.0 ? std::exp(x)
                                                        : std::numeric_limits<double>::quiet_NaN();
  }
  return t;
}

}  // namespace

const double* exp_table_16(DType dtype) {
  if (dtype == DType::kBFloat16) {
    static const std::vector<double> t = make_exp_table(DType::kBFloat16);
    return t.data();
  }
  if (dtype == DType::kFloat16) {
    static const std::vector<double> t = make_exp_table(DType::kFloat16);
    return t.data();
  }
  return nullptr;
}

}  // namespace lossguard::oracle
