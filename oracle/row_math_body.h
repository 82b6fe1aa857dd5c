// The oracle's row loops (see row_math.h), compiled once per instruction set by the
// row_math_<isa>.cpp files, which define LOSSGUARD_ORACLE_ISA first. Written so that the compiler
// vectorises them: eight independent accumulators instead of one loop-carried sum, selects instead
// of branches.
#include <cmath>
#include <cstring>
#include <limits>

#include "oracle/exp64.h"
#include "oracle/row_math.h"

namespace lossguard::oracle::LOSSGUARD_ORACLE_ISA {

constexpr int kLanes = 8;

// Storage types of the row loops: the dump's dtype read in place (no float64 copy of the row).
struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};
inline double load(double x) { return x; }
inline double load(float x) { return x; }
inline double load(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline double load(Half x) {  // exact: sign, exponent rebias, subnormals scaled, inf and NaN kept
  const uint32_t h = x.bits, sign = (h & 0x8000u) << 16, em = h & 0x7fffu;
  const uint32_t normal = (em << 13) + ((127u - 15u) << 23);
  const uint32_t infnan = (em << 13) | 0x7f800000u;
  const float sub = static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f;
  uint32_t sub_bits;
  std::memcpy(&sub_bits, &sub, 4);
  const uint32_t bits = (em >= 0x7c00u ? infnan : (em < 0x400u ? sub_bits : normal)) | sign;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
constexpr double kHuge = std::numeric_limits<double>::max();

template <typename T>
RowComparison compare_row_direct(const T* z, const T* got, int64_t begin, int64_t end, double c,
                                 double lse, const ElementBoundRow* bounds, int num_bounds) {
  RowComparison r;
  const double ac = std::fabs(c);
  // Up to two bounds (the per-dtype default and the derived one), unrolled for the vectoriser.
  const ElementBoundRow b0 = bounds[0], b1 = num_bounds > 1 ? bounds[0 + 1] : bounds[0];
  // Per lane: mismatches, NaN differences (as counts: the vectoriser keeps integer sums), the
  // largest absolute and relative differences.
  int64_t bad[kLanes] = {}, nan_count[kLanes] = {};
  double mad[kLanes] = {}, mrd[kLanes] = {};
  int64_t k = begin;
  for (; k + kLanes <= end; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const double lp = lse - load(z[k + j]);  // -log p >= 0
      const double p = exp_nonpositive(-lp);
      const double w = c * p;
      const double aw = std::fabs(w);
      const double diff = std::fabs(load(got[k + j]) - w);
      const double t0 = element_tolerance(b0, ac, aw, p, lp);
      const double t1 = element_tolerance(b1, ac, aw, p, lp);
      const double tol = t0 < t1 ? t0 : t1;
      bad[j] += diff <= tol ? 0 : 1;
      nan_count[j] += diff != diff ? 1 : 0;
      mad[j] = diff > mad[j] ? diff : mad[j];
      const double rel = diff / (aw > 0.0 ? aw : 1.0);
      mrd[j] = aw > 0.0 && rel > mrd[j] && rel < kHuge ? rel : mrd[j];
    }
  }
  for (; k < end; ++k) {
    const double lp = lse - load(z[k]);
    const double p = exp_nonpositive(-lp);
    const double w = c * p;
    const double aw = std::fabs(w);
    const double diff = std::fabs(load(got[k]) - w);
    const double t0 = element_tolerance(b0, ac, aw, p, lp);
    const double t1 = element_tolerance(b1, ac, aw, p, lp);
    const double tol = t0 < t1 ? t0 : t1;
    bad[0] += diff <= tol ? 0 : 1;
    nan_count[0] += diff != diff ? 1 : 0;
    mad[0] = diff > mad[0] ? diff : mad[0];
    const double rel = diff / (aw > 0.0 ? aw : 1.0);
    mrd[0] = aw > 0.0 && rel > mrd[0] && rel < kHuge ? rel : mrd[0];
  }
  bool nan_seen = false;
  for (int j = 0; j < kLanes; ++j) {
    r.mismatched += bad[j];
    r.max_abs_diff = mad[j] > r.max_abs_diff ? mad[j] : r.max_abs_diff;
    r.max_rel_diff = mrd[j] > r.max_rel_diff ? mrd[j] : r.max_rel_diff;
    nan_seen |= nan_count[j] > 0;
  }
  if (nan_seen) r.max_abs_diff = std::numeric_limits<double>::quiet_NaN();
  return r;
}

// Rows are widened a chunk at a time into float64 arrays that stay in L1 (one simple conversion
// loop, then the float64 loop: both vectorise; a conversion inside the float64 loop did not, and
// masking each chunk's tail instead of a scalar tail loop made the loops 2-4x slower), so no
// float64 copy of a whole row is made.
constexpr int64_t kChunk = 1024;

template <typename T>
void widen(const T* src, int64_t n, double* out) {
  for (int64_t k = 0; k < n; ++k) out[k] = load(src[k]);
}

template <typename T>
RowStats row_stats_t(const T* z, int64_t v) {
  {
    alignas(64) double buf[kChunk];
    // Pass 1: max and min; pass 2: sums relative to the max, chunk by chunk.
    double m = -std::numeric_limits<double>::infinity(), lo = std::numeric_limits<double>::infinity();
    for (int64_t k0 = 0; k0 < v; k0 += kChunk) {
      const int64_t n = v - k0 < kChunk ? v - k0 : kChunk;
      widen(z + k0, n, buf);
      double mx[kLanes], mn[kLanes];
      for (int j = 0; j < kLanes; ++j) {
        mx[j] = m;
        mn[j] = lo;
      }
      int64_t k = 0;
      for (; k + kLanes <= n; k += kLanes) {
        for (int j = 0; j < kLanes; ++j) {
          mx[j] = buf[k + j] > mx[j] ? buf[k + j] : mx[j];
          mn[j] = buf[k + j] < mn[j] ? buf[k + j] : mn[j];
        }
      }
      for (; k < n; ++k) {
        mx[0] = buf[k] > mx[0] ? buf[k] : mx[0];
        mn[0] = buf[k] < mn[0] ? buf[k] : mn[0];
      }
      for (int j = 0; j < kLanes; ++j) {
        m = mx[j] > m ? mx[j] : m;
        lo = mn[j] < lo ? mn[j] : lo;
      }
    }
    RowStats st;
    st.max = m;
    st.max_abs = v > 0 ? std::fmax(std::fabs(m), std::fabs(lo)) : 0.0;
    double sum = 0.0, dist = 0.0;
    for (int64_t k0 = 0; k0 < v; k0 += kChunk) {
      const int64_t n = v - k0 < kChunk ? v - k0 : kChunk;
      widen(z + k0, n, buf);
      double s[kLanes] = {}, d[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= n; k += kLanes) {
        for (int j = 0; j < kLanes; ++j) {
          const double x = buf[k + j] - m;
          const double e = exp_nonpositive(x);
          s[j] += e;
          d[j] -= e * x;
        }
      }
      for (; k < n; ++k) {
        const double x = buf[k] - m;
        const double e = exp_nonpositive(x);
        s[0] += e;
        d[0] -= e * x;
      }
      for (int j = 0; j < kLanes; ++j) {
        sum += s[j];
        dist += d[j];
      }
    }
    st.sum = sum;
    st.spread = sum > 0.0 ? dist / sum : 0.0;
    return st;
  }
}

template <typename T>
RowComparison compare_row_t(const T* z, const T* got, int64_t begin, int64_t end, double c,
                            double lse, const ElementBoundRow* bounds, int num_bounds) {
  {
    alignas(64) double zb[kChunk], gb[kChunk];
    RowComparison r;
    bool nan_seen = false;
    for (int64_t k0 = begin; k0 < end; k0 += kChunk) {
      const int64_t n = end - k0 < kChunk ? end - k0 : kChunk;
      widen(z + k0, n, zb);
      widen(got + k0, n, gb);
      const RowComparison part = compare_row_direct(zb, gb, 0, n, c, lse, bounds, num_bounds);
      r.mismatched += part.mismatched;
      nan_seen |= part.max_abs_diff != part.max_abs_diff;
      r.max_abs_diff = part.max_abs_diff > r.max_abs_diff ? part.max_abs_diff : r.max_abs_diff;
      r.max_rel_diff = part.max_rel_diff > r.max_rel_diff ? part.max_rel_diff : r.max_rel_diff;
    }
    if (nan_seen) r.max_abs_diff = std::numeric_limits<double>::quiet_NaN();
    return r;
  }
}

RowStats logits_row_stats(const void* z, DType dtype, int64_t v) {
  switch (dtype) {
    case DType::kBFloat16:
      return row_stats_t(static_cast<const Bf16*>(z), v);
    case DType::kFloat16:
      return row_stats_t(static_cast<const Half*>(z), v);
    case DType::kFloat32:
      return row_stats_t(static_cast<const float*>(z), v);
    default:
      return row_stats_t(static_cast<const double*>(z), v);
  }
}

RowComparison compare_logits_row(const void* z, const void* got, DType dtype, int64_t begin,
                                 int64_t end, double c, double lse, const ElementBoundRow* bounds,
                                 int num_bounds) {
  switch (dtype) {
    case DType::kBFloat16:
      return compare_row_t(static_cast<const Bf16*>(z), static_cast<const Bf16*>(got), begin, end,
                           c, lse, bounds, num_bounds);
    case DType::kFloat16:
      return compare_row_t(static_cast<const Half*>(z), static_cast<const Half*>(got), begin, end,
                           c, lse, bounds, num_bounds);
    case DType::kFloat32:
      return compare_row_t(static_cast<const float*>(z), static_cast<const float*>(got), begin,
                           end, c, lse, bounds, num_bounds);
    default:
      return compare_row_t(static_cast<const double*>(z), static_cast<const double*>(got), begin,
                           end, c, lse, bounds, num_bounds);
  }
}

RowComparison compare_zero_row(const double* got, int64_t n, double tol, int64_t* nonzero) {
  RowComparison r;
  int64_t bad[kLanes] = {}, nz[kLanes] = {}, nan_count[kLanes] = {};
  double mad[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const double d = std::fabs(got[k + j]);
      bad[j] += d <= tol ? 0 : 1;
      nz[j] += d != 0.0 ? 1 : 0;
      nan_count[j] += d != d ? 1 : 0;
      mad[j] = d > mad[j] ? d : mad[j];
    }
  }
  for (; k < n; ++k) {
    const double d = std::fabs(got[k]);
    bad[0] += d <= tol ? 0 : 1;
    nz[0] += d != 0.0 ? 1 : 0;
    nan_count[0] += d != d ? 1 : 0;
    mad[0] = d > mad[0] ? d : mad[0];
  }
  int64_t nans = 0;
  *nonzero = 0;
  for (int j = 0; j < kLanes; ++j) {
    r.mismatched += bad[j];
    *nonzero += nz[j];
    nans += nan_count[j];
    r.max_abs_diff = mad[j] > r.max_abs_diff ? mad[j] : r.max_abs_diff;
  }
  if (nans > 0) r.max_abs_diff = std::numeric_limits<double>::quiet_NaN();
  r.max_rel_diff = 0.0;
  return r;
}

bool row_is_zero(const void* src, DType dtype, int64_t n) {
  const std::size_t e = dtype_size_bytes(dtype);
  // Every bit but the signs: -0 is zero.
  const uint64_t magnitude = e == 2   ? 0x7fff7fff7fff7fffull
                             : e == 4 ? 0x7fffffff7fffffffull
                                      : 0x7fffffffffffffffull;
  const unsigned char* p = static_cast<const unsigned char*>(src);
  const std::size_t bytes = static_cast<std::size_t>(n) * e;
  uint64_t acc[kLanes] = {};
  std::size_t k = 0;
  for (; k + 8 * kLanes <= bytes; k += 8 * kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      uint64_t w;
      std::memcpy(&w, p + k + 8 * j, 8);
      acc[j] |= w & magnitude;
    }
  }
  uint64_t any = 0;
  for (int j = 0; j < kLanes; ++j) any |= acc[j];
  for (; k < bytes; k += e) {  // the tail, one value at a time (e bytes: the mask's low ones)
    uint64_t w = 0;
    std::memcpy(&w, p + k, e);
    any |= w & magnitude;
  }
  return any == 0;
}

void row_to_f64(const void* src, DType dtype, int64_t n, double* out) {
  auto copy = [&](auto* typed) {
    for (int64_t k = 0; k < n; ++k) out[k] = load(typed[k]);
  };
  switch (dtype) {
    case DType::kBFloat16:
      return copy(static_cast<const Bf16*>(src));
    case DType::kFloat16:
      return copy(static_cast<const Half*>(src));
    case DType::kFloat32:
      return copy(static_cast<const float*>(src));
    case DType::kFloat64:
      return copy(static_cast<const double*>(src));
    default: {
      HostArray view;
      view.dtype = dtype;
      view.shape = {n};
      view.data = static_cast<const std::byte*>(src);
      view.copy_f64(0, n, out);
    }
  }
}

}  // namespace lossguard::oracle::LOSSGUARD_ORACLE_ISA
