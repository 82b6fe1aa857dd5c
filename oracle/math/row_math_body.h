// The oracle's row loops (see row_math.h), compiled once per instruction set by the
// row_math_<isa>.cpp files, which define LOSSGUARD_ORACLE_ISA first. Written so that the compiler
// vectorises them: eight independent accumulators instead of one loop-carried sum, selects instead
// of branches.
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "oracle/math/exp32.h"
#include "oracle/math/exp64.h"
#include "oracle/math/row_math.h"

namespace lossguard::oracle::LOSSGUARD_ORACLE_ISA {

constexpr int kLanes = 8;

// Storage types of the row loops: the dump's dtype read in place (no float64 copy of the row).
struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};
// Read in place as arrays of 16-bit patterns (exp_from_table's gather indexes by them).
static_assert(sizeof(Bf16) == 2 && sizeof(Half) == 2);
inline double load(double x) { return x; }
inline double load(float x) { return x; }
inline double load(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float load_f32(float x) { return x; }
inline float load_f32(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline float load_f32(
    Half x) {  // exact: sign, exponent rebias, subnormals scaled, inf and NaN kept
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
inline double load(Half x) { return load_f32(x); }
constexpr double kHuge = std::numeric_limits<double>::max();

// z and got as float64; `pz`, when kTabled, holds p_k = e^(z_k - lse) from the 16-bit table.
// kScreen: instead of each element's tolerance, the lower bound of every bound
//   L = (atol_min + q (rtol_min + alpha_min + beta_min lp)) (1 - 2^-40),  q = |c| p = |w|
// (grow(x) >= x for x >= 0; every term of the bounds is nonnegative; the factor covers the
// roundings), about a third of the arithmetic: `mismatched` then counts the elements over L, and
// is 0 only if every element is within its bound. Elements over L are rare in a right candidate
// (its bounds carry a margin of 2 or more), so compare_row_t judges a chunk exactly only then.
template <bool kTabled, bool kScreen>
RowComparison compare_row_direct(const double* z, const double* got, const double* pz,
                                 int64_t begin, int64_t end, double c, double lse,
                                 const ElementBoundRow* bounds, int num_bounds) {
  RowComparison r;
  const double ac = std::fabs(c);
  // Up to two bounds (the per-dtype default and the derived one), unrolled for the vectoriser.
  const ElementBoundRow b0 = bounds[0], b1 = num_bounds > 1 ? bounds[0 + 1] : bounds[0];
  const double atol_min = std::fmin(b0.atol, b1.atol), rtol_min = std::fmin(b0.rtol, b1.rtol);
  const double per_q = rtol_min + std::fmin(b0.alpha, b1.alpha),
               beta_min = std::fmin(b0.beta, b1.beta);
  constexpr double kShrink = 1.0 - 0x1p-40;
  // Per lane: mismatches, NaN differences (as counts: the vectoriser keeps integer sums), the
  // largest absolute difference, and the element with the largest finite relative difference
  // diff / |w| kept as the pair (rd, rw): a new element wins if diff rw > rd |w|, so the loop
  // divides nowhere (a vector division's latency was an eighth of check's time).
  int64_t bad[kLanes] = {}, nan_count[kLanes] = {};
  double mad[kLanes] = {}, rd[kLanes] = {}, rw[kLanes];
  for (int j = 0; j < kLanes; ++j) rw[j] = 1.0;
  auto element = [&](int j, double zk, double gk, double pk) {
    const double lp = lse - zk;  // -log p >= 0
    // The table's product below exp_nonpositive's cut-off is 0 too, as the polynomial has it.
    const double p = kTabled ? (lp > 708.0 ? 0.0 : pk) : exp_nonpositive(-lp);
    const double w = c * p;
    const double aw = std::fabs(w);
    const double diff = std::fabs(gk - w);
    if constexpr (kScreen) {
      bad[j] += diff <= (atol_min + aw * (per_q + beta_min * lp)) * kShrink ? 0 : 1;
    } else {
      const double t0 = element_tolerance(b0, ac, aw, p, lp);
      const double t1 = element_tolerance(b1, ac, aw, p, lp);
      const double tol = t0 < t1 ? t0 : t1;
      bad[j] += diff <= tol ? 0 : 1;
      nan_count[j] += diff != diff ? 1 : 0;
    }
    mad[j] = diff > mad[j] ? diff : mad[j];
    // aw > 0, a finite ratio (diff < kHuge aw; false for NaN and infinite diff), and larger.
    const bool wins = aw > 0.0 && diff < kHuge * aw && diff * rw[j] > rd[j] * aw;
    rd[j] = wins ? diff : rd[j];
    rw[j] = wins ? aw : rw[j];
  };
  int64_t k = begin;
  for (; k + kLanes <= end; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) element(j, z[k + j], got[k + j], kTabled ? pz[k + j] : 0.0);
  }
  for (; k < end; ++k) element(0, z[k], got[k], kTabled ? pz[k] : 0.0);
  bool nan_seen = false;
  for (int j = 0; j < kLanes; ++j) {
    r.mismatched += bad[j];
    r.max_abs_diff = mad[j] > r.max_abs_diff ? mad[j] : r.max_abs_diff;
    const double rel = rd[j] / rw[j];
    r.max_rel_diff = rel > r.max_rel_diff ? rel : r.max_rel_diff;
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
void widen_f32(const T* src, int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) out[k] = load_f32(src[k]);
}

// The 16-bit table of e^x (exp_table_16) of a storage type, nullptr for float and double.
template <typename T>
const double* exp_table_of() {
  if constexpr (std::is_same_v<T, Bf16>) return exp_table_16(DType::kBFloat16);
  if constexpr (std::is_same_v<T, Half>) return exp_table_16(DType::kFloat16);
  return nullptr;
}

// out[k] = e^(src[k] - s) = table[bits] * e^-s for n values of a 16-bit row, e_neg_s = e^-s with
// |s| <= 700; false if a value has no entry (non-finite or |x| > 700): the caller then uses the
// polynomial for this chunk.
template <typename T>
bool exp_from_table(const double* table, const T* src, int64_t n, double e_neg_s, double* out) {
  if constexpr (std::is_same_v<T, Bf16> || std::is_same_v<T, Half>) {
    int64_t missing = 0, k = 0;
    // The compilers leave this loop scalar (a gather is not worth it under their generic tuning);
    // with the gather instruction it takes a third of the polynomial's time here.
#if defined(__AVX512F__)
    {
      const __m512d scale = _mm512_set1_pd(e_neg_s);
      __mmask8 nan = 0;
      for (; k + 8 <= n; k += 8) {
        const __m256i idx =
            _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k)));
        const __m512d e = _mm512_i32gather_pd(idx, table, 8);
        nan |= _mm512_cmp_pd_mask(e, e, _CMP_UNORD_Q);
        _mm512_storeu_pd(out + k, _mm512_mul_pd(e, scale));
      }
      missing += nan != 0 ? 1 : 0;
    }
#elif defined(__AVX2__)
    {
      const __m256d scale = _mm256_set1_pd(e_neg_s);
      __m256d nan = _mm256_setzero_pd();
      for (; k + 4 <= n; k += 4) {
        const __m128i idx =
            _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + k)));
        const __m256d e = _mm256_i32gather_pd(table, idx, 8);
        nan = _mm256_or_pd(nan, _mm256_cmp_pd(e, e, _CMP_UNORD_Q));
        _mm256_storeu_pd(out + k, _mm256_mul_pd(e, scale));
      }
      missing += _mm256_movemask_pd(nan) != 0 ? 1 : 0;
    }
#endif
    for (; k < n; ++k) {
      const double e = table[src[k].bits];
      missing += e != e ? 1 : 0;
      out[k] = e * e_neg_s;
    }
    return missing == 0;
  } else {
    (void)table, (void)src, (void)n, (void)e_neg_s, (void)out;
    return false;
  }
}

// Folds the smallest and largest of n values into *lo and *hi (NaN skipped). The compiler leaves
// the lane loop below scalar (a double max is not a reduction it may reorder), so the vector forms
// are written out: max_pd(x, m) is x > m ? x : m, NaN included, as the scalar form.
inline void min_max(const double* buf, int64_t n, double* lo, double* hi) {
  double mx[kLanes], mn[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    mx[j] = *hi;
    mn[j] = *lo;
  }
  int64_t k = 0;
#if defined(__AVX512F__)
  {
    __m512d vmx = _mm512_loadu_pd(mx), vmn = _mm512_loadu_pd(mn);
    for (; k + 8 <= n; k += 8) {
      const __m512d x = _mm512_loadu_pd(buf + k);
      vmx = _mm512_max_pd(x, vmx);
      vmn = _mm512_min_pd(x, vmn);
    }
    _mm512_storeu_pd(mx, vmx);
    _mm512_storeu_pd(mn, vmn);
  }
#elif defined(__AVX2__)
  {
    __m256d vmx0 = _mm256_loadu_pd(mx), vmx1 = _mm256_loadu_pd(mx + 4);
    __m256d vmn0 = _mm256_loadu_pd(mn), vmn1 = _mm256_loadu_pd(mn + 4);
    for (; k + 8 <= n; k += 8) {
      const __m256d x0 = _mm256_loadu_pd(buf + k), x1 = _mm256_loadu_pd(buf + k + 4);
      vmx0 = _mm256_max_pd(x0, vmx0);
      vmx1 = _mm256_max_pd(x1, vmx1);
      vmn0 = _mm256_min_pd(x0, vmn0);
      vmn1 = _mm256_min_pd(x1, vmn1);
    }
    _mm256_storeu_pd(mx, vmx0);
    _mm256_storeu_pd(mx + 4, vmx1);
    _mm256_storeu_pd(mn, vmn0);
    _mm256_storeu_pd(mn + 4, vmn1);
  }
#endif
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
    *hi = mx[j] > *hi ? mx[j] : *hi;
    *lo = mn[j] < *lo ? mn[j] : *lo;
  }
}

// min_max of n bf16 values read in place, 16 (AVX-512) or 8 (AVX2) float lanes: a bf16 value is
// its bits shifted into a float's upper half, exactly, and max_ps(x, m) is x > m ? x : m as in
// min_max (NaN skipped).
inline void min_max_bf16(const Bf16* z, int64_t n, double* lo, double* hi) {
  float mx = static_cast<float>(*hi), mn = static_cast<float>(*lo);  // +-inf at the start
  int64_t k = 0;
#if defined(__AVX512F__)
  {
    __m512 vmx = _mm512_set1_ps(mx), vmn = _mm512_set1_ps(mn);
    for (; k + 16 <= n; k += 16) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(z + k));
      const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
      vmx = _mm512_max_ps(x, vmx);
      vmn = _mm512_min_ps(x, vmn);
    }
    alignas(64) float a[16], c[16];
    _mm512_store_ps(a, vmx);
    _mm512_store_ps(c, vmn);
    for (int j = 0; j < 16; ++j) {
      mx = a[j] > mx ? a[j] : mx;
      mn = c[j] < mn ? c[j] : mn;
    }
  }
#elif defined(__AVX2__)
  {
    __m256 vmx = _mm256_set1_ps(mx), vmn = _mm256_set1_ps(mn);
    for (; k + 8 <= n; k += 8) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(z + k));
      const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
      vmx = _mm256_max_ps(x, vmx);
      vmn = _mm256_min_ps(x, vmn);
    }
    alignas(32) float a[8], c[8];
    _mm256_store_ps(a, vmx);
    _mm256_store_ps(c, vmn);
    for (int j = 0; j < 8; ++j) {
      mx = a[j] > mx ? a[j] : mx;
      mn = c[j] < mn ? c[j] : mn;
    }
  }
#endif
  for (; k < n; ++k) {
    const float x = load_f32(z[k]);
    mx = x > mx ? x : mx;
    mn = x < mn ? x : mn;
  }
  *hi = mx;
  *lo = mn;
}

// Adds sum_k e^(x_k) and -sum_k e^(x_k) x_k, x_k = z_k - m, over n values of a chunk (z widened
// to float64 in buf) to *sum and *dist; kTabled: e^(x_k) is eb[k] (exp_from_table), 0 below the
// polynomial's cut-off as the polynomial has it.
template <bool kTabled>
void exp_sums(const double* buf, const double* eb, int64_t n, double m, double* sum, double* dist) {
  double s[kLanes] = {}, d[kLanes] = {};
  int64_t k = 0;
  // The tabled form written out (the compiler vectorised each step but added the eight lanes one
  // by one, a third of check's row statistics): lane j still sums elements j mod 8, in order.
#if defined(__AVX512F__)
  if constexpr (kTabled) {
    __m512d vs = _mm512_setzero_pd(), vd = _mm512_setzero_pd();
    const __m512d vm = _mm512_set1_pd(m), cut = _mm512_set1_pd(-708.0);
    for (; k + 8 <= n; k += 8) {
      const __m512d x = _mm512_sub_pd(_mm512_loadu_pd(buf + k), vm);
      const __mmask8 under = _mm512_cmp_pd_mask(x, cut, _CMP_LT_OQ);  // NaN: not under
      const __m512d e = _mm512_maskz_mov_pd(static_cast<__mmask8>(~under), _mm512_loadu_pd(eb + k));
      vs = _mm512_add_pd(vs, e);
      vd = _mm512_fnmadd_pd(e, x, vd);
    }
    _mm512_storeu_pd(s, vs);
    _mm512_storeu_pd(d, vd);
  }
#elif defined(__AVX2__)
  if constexpr (kTabled) {
    __m256d vs0 = _mm256_setzero_pd(), vs1 = _mm256_setzero_pd();
    __m256d vd0 = _mm256_setzero_pd(), vd1 = _mm256_setzero_pd();
    const __m256d vm = _mm256_set1_pd(m), cut = _mm256_set1_pd(-708.0);
    for (; k + 8 <= n; k += 8) {
      const __m256d x0 = _mm256_sub_pd(_mm256_loadu_pd(buf + k), vm);
      const __m256d x1 = _mm256_sub_pd(_mm256_loadu_pd(buf + k + 4), vm);
      const __m256d e0 =
          _mm256_andnot_pd(_mm256_cmp_pd(x0, cut, _CMP_LT_OQ), _mm256_loadu_pd(eb + k));
      const __m256d e1 =
          _mm256_andnot_pd(_mm256_cmp_pd(x1, cut, _CMP_LT_OQ), _mm256_loadu_pd(eb + k + 4));
      vs0 = _mm256_add_pd(vs0, e0);
      vs1 = _mm256_add_pd(vs1, e1);
      vd0 = _mm256_fnmadd_pd(e0, x0, vd0);
      vd1 = _mm256_fnmadd_pd(e1, x1, vd1);
    }
    _mm256_storeu_pd(s, vs0);
    _mm256_storeu_pd(s + 4, vs1);
    _mm256_storeu_pd(d, vd0);
    _mm256_storeu_pd(d + 4, vd1);
  }
#endif
  // The table's value is read unconditionally, then selected: a load under the condition kept the
  // loop scalar.
  for (; k + kLanes <= n; k += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const double x = buf[k + j] - m;
      const double t = kTabled ? eb[k + j] : 0.0;
      const double e = kTabled ? (x < -708.0 ? 0.0 : t) : exp_nonpositive(x);
      s[j] += e;
      d[j] -= e * x;
    }
  }
  for (; k < n; ++k) {
    const double x = buf[k] - m;
    const double t = kTabled ? eb[k] : 0.0;
    const double e = kTabled ? (x < -708.0 ? 0.0 : t) : exp_nonpositive(x);
    s[0] += e;
    d[0] -= e * x;
  }
  for (int j = 0; j < kLanes; ++j) {
    *sum += s[j];
    *dist += d[j];
  }
}

template <typename T>
RowStats row_stats_t(const T* z, int64_t v) {
  {
    alignas(64) double buf[kChunk];
    // Pass 1: max and min; pass 2: sums relative to the max, chunk by chunk.
    double m = -std::numeric_limits<double>::infinity(),
           lo = std::numeric_limits<double>::infinity();
    if constexpr (std::is_same_v<T, Bf16>) {
      min_max_bf16(z, v, &lo, &m);
    } else {
      for (int64_t k0 = 0; k0 < v; k0 += kChunk) {
        const int64_t n = v - k0 < kChunk ? v - k0 : kChunk;
        widen(z + k0, n, buf);
        min_max(buf, n, &lo, &m);
      }
    }
    RowStats st;
    st.max = m;
    st.max_abs = v > 0 ? std::fmax(std::fabs(m), std::fabs(lo)) : 0.0;
    double sum = 0.0, dist = 0.0;
    alignas(64) double eb[kChunk];
    const double* table = std::fabs(m) <= 700.0 ? exp_table_of<T>() : nullptr;
    const double e_neg_m = table != nullptr ? std::exp(-m) : 0.0;
    for (int64_t k0 = 0; k0 < v; k0 += kChunk) {
      const int64_t n = v - k0 < kChunk ? v - k0 : kChunk;
      widen(z + k0, n, buf);
      if (table != nullptr && exp_from_table(table, z + k0, n, e_neg_m, eb)) {
        exp_sums<true>(buf, eb, n, m, &sum, &dist);
      } else {
        exp_sums<false>(buf, eb, n, m, &sum, &dist);
      }
    }
    st.sum = sum;
    st.spread = sum > 0.0 ? dist / sum : 0.0;
    // NaN or +inf makes the sum NaN (+inf - +inf), -inf makes max_abs infinite.
    st.non_finite = !(std::isfinite(sum) && std::isfinite(st.max_abs));
    return st;
  }
}

constexpr float kFloatMax = std::numeric_limits<float>::max();

// Whether the screen certifies n elements of a 16-bit chunk, read as float32 (exactly) from z and
// got (row_math.h, LogitsScreen; the derivation of every constant is in logits_screen).
// Written for the vectoriser: 16 float lanes, one flag folded with OR, selects instead of
// branches; a NaN anywhere fails a comparison.
template <typename T>
bool screen_chunk(const T* z, const T* got, int64_t n, const LogitsScreen& s) {
  int bad = 0;
  for (int64_t k = 0; k < n; ++k) {
    const float lp = s.lse - load_f32(z[k]);
    const float p = exp_screen(-lp);
    const float diff = std::fabs(load_f32(got[k]) * s.inv_c - p);
    const float pd = p * (s.d0 + s.d1 * lp);
    const float ub = diff * s.k + pd;
    const float bound = s.atol + (p - pd) * (s.per_q + s.beta * lp);
    // Bitwise, not &&: a short-circuit is control flow, which keeps the loop scalar.
    const int ok = static_cast<int>(ub <= bound) & static_cast<int>(ub < kFloatMax) &
                   static_cast<int>(lp <= s.lp_max) & static_cast<int>(lp >= s.lp_min) &
                   static_cast<int>(!(ub > s.max_abs)) &
                   static_cast<int>(!(ub > s.max_rel * (p - pd)));
    bad |= ok ^ 1;
  }
  return bad == 0;
}

template <typename T>
RowComparison compare_row_t(const T* z, const T* got, int64_t begin, int64_t end, double c,
                            double lse, const ElementBoundRow* bounds, int num_bounds,
                            const LogitsScreen* screen) {
  {
    alignas(64) double zb[kChunk], gb[kChunk], pb[kChunk];
    const double* table = std::fabs(lse) <= 700.0 ? exp_table_of<T>() : nullptr;
    const double e_neg_lse = table != nullptr ? std::exp(-lse) : 0.0;
    RowComparison r;
    bool nan_seen = false;
    for (int64_t k0 = begin; k0 < end; k0 += kChunk) {
      const int64_t n = end - k0 < kChunk ? end - k0 : kChunk;
      if constexpr (std::is_same_v<T, Bf16> || std::is_same_v<T, Half>) {
        if (screen != nullptr && screen->on) {
          if constexpr (std::is_same_v<T, Bf16>) {  // read in place: bf16 to float is a shift
            if (screen_chunk(z + k0, got + k0, n, *screen)) continue;
          } else {  // fp16 widened first: its conversion inside the loop keeps the loop scalar
            alignas(64) float zf[kChunk], gf[kChunk];
            widen_f32(z + k0, n, zf);
            widen_f32(got + k0, n, gf);
            if (screen_chunk(zf, gf, n, *screen)) continue;
          }
        }
      }
      widen(z + k0, n, zb);
      widen(got + k0, n, gb);
      const bool tabled = table != nullptr && exp_from_table(table, z + k0, n, e_neg_lse, pb);
      // The screen first; the exact tolerances only for a chunk with an element over it (a NaN
      // difference is over it too, and is counted there).
      RowComparison part =
          tabled
              ? compare_row_direct<true, true>(zb, gb, pb, 0, n, c, lse, bounds, num_bounds)
              : compare_row_direct<false, true>(zb, gb, nullptr, 0, n, c, lse, bounds, num_bounds);
      if (part.mismatched != 0) {
        part = tabled
                   ? compare_row_direct<true, false>(zb, gb, pb, 0, n, c, lse, bounds, num_bounds)
                   : compare_row_direct<false, false>(zb, gb, nullptr, 0, n, c, lse, bounds,
                                                      num_bounds);
      }
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
                                 int num_bounds, const LogitsScreen* screen) {
  switch (dtype) {
    case DType::kBFloat16:
      return compare_row_t(static_cast<const Bf16*>(z), static_cast<const Bf16*>(got), begin, end,
                           c, lse, bounds, num_bounds, screen);
    case DType::kFloat16:
      return compare_row_t(static_cast<const Half*>(z), static_cast<const Half*>(got), begin, end,
                           c, lse, bounds, num_bounds, screen);
    case DType::kFloat32:
      return compare_row_t(static_cast<const float*>(z), static_cast<const float*>(got), begin, end,
                           c, lse, bounds, num_bounds, screen);
    default:
      return compare_row_t(static_cast<const double*>(z), static_cast<const double*>(got), begin,
                           end, c, lse, bounds, num_bounds, screen);
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

void exp_screen_row(const float* x, int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) out[k] = exp_screen(x[k]);
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
