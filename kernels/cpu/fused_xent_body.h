// The CPU twin's row kernels, written once with GCC/Clang vector extensions (as many float lanes as
// the instruction set's registers hold: wider vectors are split, and their selects scalarised) and
// compiled once per instruction set by the fused_xent_<isa>.cpp files, which define
// LOSSGUARD_XENT_ISA first. One exponential per element. Per row, pass 1 walks the logits in
// 2048-element blocks into a row-sized scratch (in cache): the first block takes its maximum, then
// replaces itself by exp(z - m); every later block takes one sweep, exp(z - m) against the running
// maximum m with its own maximum alongside (redone as the first when that maximum rises by more
// than kSlack, or is not finite); the sum is rescaled (in double) when m grows. Pass 2 reads the
// scratch, not the logits: the gradient is c * exp(m_block - lse) * scratch, streamed out block by
// block while the next row's pass 1 runs (two scratches), and the target element c * (p_y - 1) is
// written last. No standard-library templates here: their out-of-line copies would
// carry this TU's instruction set into code the linker may share with the others (an ODR trap), so
// scratch comes from malloc and min is local.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kernels/cpu/fused_xent_rows.h"

namespace lossguard::kernels::LOSSGUARD_XENT_ISA {

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#elif defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
constexpr int64_t kBlock =
    kXentBlock;  // 8 KiB of float: a block stays in L1 between its two sweeps
constexpr float kSlack = 20.0f;
constexpr int64_t kPrefetch = 1024;  // a one-sweep block's exponentials stay below e^20
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
inline vf splat(float x) { return vf{} + x; }
inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

// exp for x <= 0: x = n ln2 + r (n = round(x / ln2), ln2 in two parts, |r| <= ln2/2), e^r by a
// degree-6 polynomial (near-minimax for relative error on [-ln2/2, ln2/2], 1.9e-9 before rounding;
// fitted by iteratively reweighted least squares, 1.6 ulp in float Horner evaluation), scaled by
// 2^n. AVX-512 scales with vscalefps, which underflows to 0 and keeps NaN by itself; elsewhere 2^n
// goes into the exponent bits, so below -86 the result is set to 0 (exp(-86) = 4e-38 sits under
// every tolerance and keeps 2^n normal) and NaN is passed through.
inline vf exp_poly(vf r) {
  vf p = splat(1.3836845755577087e-3f);
  p = p * r + 8.374815806746483e-3f;
  p = p * r + 4.166822507977486e-2f;
  p = p * r + 1.6666419804096222e-1f;
  p = p * r + 4.9999991059303284e-1f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}
#if defined(__AVX512F__)
inline vf vexp(vf x) {
  const __m512 n = _mm512_roundscale_ps((__m512)(x * 1.44269504088896341f),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vf r = x - (vf)n * 0.693359375f;
  r = r - (vf)n * -2.12194440e-4f;
  return (vf)_mm512_scalef_ps((__m512)exp_poly(r), n);
}
#else
inline vf vexp(vf x) {
  const vf lo = splat(-86.0f),
           magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf xc = x < lo ? lo : x;
  const vf t = xc * 1.44269504088896341f + magic;
  const vf n = t - magic;
  const vi ni = (vi)t - (vi)magic;
  vf r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf y = (vf)((vi)exp_poly(r) + (ni << 23));
  y = x < lo ? splat(0.0f) : y;
  return x != x ? x : y;
}
#endif

inline float hmax(vf v) {
  float m = v[0];
  for (int k = 1; k < kLanes; ++k) m = v[k] > m ? v[k] : m;
  return m;
}
inline float hsum(vf v) {
  float s = 0.0f;
  for (int k = 0; k < kLanes; ++k) s += v[k];
  return s;
}

// float16 <-> float32 without F16C: exact (normal, subnormal, inf, NaN).
inline vf half_bits_to_float(vu h) {
  const vu sign = (h & 0x8000u) << 16, em = h & 0x7fffu;
  const vu normal = (em << 13) + ((127u - 15u) << 23);
  const vu infnan = (em << 13) | 0x7f800000u;
  const vf sub = __builtin_convertvector((vi)em, vf) * 5.9604644775390625e-8f;  // em * 2^-24
  const vu bits = em >= 0x7c00u ? infnan : (em < 0x400u ? (vu)sub : normal);
  return (vf)(bits | sign);
}

// Non-temporal stores of one vector (N bytes) at an N-byte aligned address.
constexpr uintptr_t kStreamAlign = 64;
template <int N>
inline void stream_bytes(void* p, const void* v) {
#if defined(__AVX512F__)
  if constexpr (N == 64)
    return _mm512_stream_si512(static_cast<__m512i*>(p), _mm512_loadu_si512(v));
#endif
#if defined(__AVX__)
  if constexpr (N == 32)
    return _mm256_stream_si256(static_cast<__m256i*>(p),
                               _mm256_loadu_si256(static_cast<const __m256i*>(v)));
#endif
#if defined(__SSE2__)
  if constexpr (N == 16)
    return _mm_stream_si128(static_cast<__m128i*>(p),
                            _mm_loadu_si128(static_cast<const __m128i*>(v)));
  if constexpr (N == 8) {
    long long x;
    std::memcpy(&x, v, 8);
    return _mm_stream_si64(static_cast<long long*>(p), x);
  }
#endif
  std::memcpy(p, v, N);
}
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

template <typename T>
struct Io;
template <>
struct Io<float> {
  static vf load(const float* p) { return vload(p); }
  static float scalar(const float* p) { return *p; }
  static void store(float* p, vf v) { vstore(p, v); }
  static void stream(float* p, vf v) { stream_bytes<sizeof(vf)>(p, &v); }
  static void store_scalar(float* p, float v) { *p = v; }
};
template <>
struct Io<BFloat16Bits> {
  static vf load(const BFloat16Bits* p) {
    vh h;
    std::memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
  }
  static float scalar(const BFloat16Bits* p) {
    const uint32_t b = static_cast<uint32_t>(p->bits) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
  static void store(BFloat16Bits* p, vf v) {  // round to nearest even; NaN stays NaN
    const vu b = (vu)v;
    const vu rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
    const vu out = (b & 0x7fffffffu) > 0x7f800000u ? ((b >> 16) | 0x40u) : rounded;
    const vh h = __builtin_convertvector(out, vh);
    std::memcpy(p, &h, sizeof h);
  }
  static void stream(BFloat16Bits* p, vf v) {
    BFloat16Bits tmp[kLanes];
    store(tmp, v);
    stream_bytes<sizeof(vh)>(p, tmp);
  }
  static void store_scalar(BFloat16Bits* p, float v) { p->bits = float_to_bfloat16(v); }
};
template <>
struct Io<HalfBits> {
  static vf load(const HalfBits* p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    vh h;
    std::memcpy(&h, p, sizeof h);
    return half_bits_to_float(__builtin_convertvector(h, vu));
#endif
  }
  static float scalar(const HalfBits* p) { return half_to_float(p->bits); }
  static void store(HalfBits* p, vf v) {
#if defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph((__m256)v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    for (int k = 0; k < kLanes; ++k) p[k].bits = float_to_half(v[k]);
#endif
  }
  static void store_scalar(HalfBits* p, float v) { p->bits = float_to_half(v); }
  static void stream(HalfBits* p, vf v) {
    HalfBits tmp[kLanes];
    store(tmp, v);
    stream_bytes<sizeof(vh)>(p, tmp);
  }
};

// A row whose gradient is still to be written: its scratch, block references and lse.
template <typename T>
struct PendingRow {
  T* g = nullptr;
  const float* sc = nullptr;
  const float* block_max = nullptr;
  double lse = 0.0, zy = 0.0;
  float c = 0.0f;
  int64_t y = 0;
};

// Pass 2 of block blk of a row of v logits (in `blocks` blocks): the gradient
// c * exp(block_max - lse) * exp(z - block_max), streamed out of the row's scratch.
template <typename T>
inline void grad_block(const PendingRow<T>& p, int64_t blk, int64_t v, int64_t blocks) {
  const int64_t b0 = blk * kBlock, n = min64(kBlock, v - b0);
  T* g = p.g;
  const float* sc = p.sc;
  const float f = static_cast<float>(p.c * std::exp(static_cast<double>(p.block_max[blk]) - p.lse));
  const vf vfac = splat(f);
  int64_t k = 0;
  // Whole cache lines bypass the cache (no read-for-ownership of the gradient) once aligned.
  for (; k < n && reinterpret_cast<uintptr_t>(g + b0 + k) % kStreamAlign != 0; ++k)
    Io<T>::store_scalar(g + b0 + k, sc[b0 + k] * f);
  for (; k + kLanes <= n; k += kLanes) Io<T>::stream(g + b0 + k, vload(sc + b0 + k) * vfac);
  for (; k < n; ++k) Io<T>::store_scalar(g + b0 + k, sc[b0 + k] * f);
  if (blk == blocks - 1)  // c (p_y - 1), no cancellation: after the block that holds y
    Io<T>::store_scalar(p.g + p.y, static_cast<float>(p.c * std::expm1(p.zy - p.lse)));
}

// Pass 1 of the n logits z[b0, b0 + n) once the running maximum m is finite: one sweep,
// exp(z - m) into the scratch sc with the block's own maximum alongside. Kept (true, with the
// block's reference block_max = m and the sum s updated) when that maximum is at most m + kSlack
// (the exponentials stay below e^kSlack, far from float's range); else false, and the caller redoes
// the block with sum_block_two_sweeps from the cached logits (a rise of the maximum that large,
// +inf or NaN).
template <typename T>
inline bool sum_block_one_sweep(const T* z, float* sc, int64_t b0, int64_t n, float& m, double& s,
                                float& block_max) {
  const vf vm = splat(m);
  vf mx0 = splat(-std::numeric_limits<float>::infinity()), mx1 = mx0;
  vf vs = splat(0.0f), vs1 = splat(0.0f);
  int64_t k = 0;
  for (; k + 2 * kLanes <= n; k += 2 * kLanes) {
    __builtin_prefetch(z + b0 + k + kPrefetch, 0, 3);
    const vf x0 = Io<T>::load(z + b0 + k), x1 = Io<T>::load(z + b0 + k + kLanes);
    mx0 = x0 > mx0 ? x0 : mx0;
    mx1 = x1 > mx1 ? x1 : mx1;
    const vf e0 = vexp(x0 - vm), e1 = vexp(x1 - vm);
    vstore(sc + b0 + k, e0);
    vstore(sc + b0 + k + kLanes, e1);
    vs += e0;
    vs1 += e1;
  }
  for (; k + kLanes <= n; k += kLanes) {
    const vf x = Io<T>::load(z + b0 + k);
    mx0 = x > mx0 ? x : mx0;
    const vf e = vexp(x - vm);
    vstore(sc + b0 + k, e);
    vs += e;
  }
  float bm = hmax(mx1 > mx0 ? mx1 : mx0), bs = hsum(vs) + hsum(vs1);
  for (; k < n; ++k) {
    const float x = Io<T>::scalar(z + b0 + k);
    bm = x > bm ? x : bm;
    const float e = std::exp(x - m);
    sc[b0 + k] = e;
    bs += e;
  }
  if (bm <= m + kSlack) {
    block_max = m;
    s += bs;
    if (bm > m) {
      s *= std::exp(static_cast<double>(m) - bm);
      m = bm;
    }
    return true;
  }
  return false;
}

// Pass 1 of the n logits z[b0, b0 + n) in two sweeps: the block's maximum (rescaling the sum s
// when it raises the running maximum m, which becomes the block's reference block_max), then
// exp(z - m) into the scratch sc.
template <typename T>
inline void sum_block_two_sweeps(const T* z, float* sc, int64_t b0, int64_t n, float& m, double& s,
                                 float& block_max) {
  // Four independent maxima: one chain would wait a max latency per vector.
  const vf ninf = splat(-std::numeric_limits<float>::infinity());
  vf mx0 = ninf, mx1 = ninf, mx2 = ninf, mx3 = ninf;
  int64_t k = 0;
  // float logits are read again from L1 by the exp sweep; narrower ones are widened once here.
  constexpr bool kWiden = !std::is_same_v<T, float>;
  const float* src = kWiden ? sc : reinterpret_cast<const float*>(z);
  for (; k + 4 * kLanes <= n; k += 4 * kLanes) {
    const vf x0 = Io<T>::load(z + b0 + k), x1 = Io<T>::load(z + b0 + k + kLanes);
    const vf x2 = Io<T>::load(z + b0 + k + 2 * kLanes), x3 = Io<T>::load(z + b0 + k + 3 * kLanes);
    if constexpr (kWiden) {
      vstore(sc + b0 + k, x0);
      vstore(sc + b0 + k + kLanes, x1);
      vstore(sc + b0 + k + 2 * kLanes, x2);
      vstore(sc + b0 + k + 3 * kLanes, x3);
    }
    mx0 = x0 > mx0 ? x0 : mx0;
    mx1 = x1 > mx1 ? x1 : mx1;
    mx2 = x2 > mx2 ? x2 : mx2;
    mx3 = x3 > mx3 ? x3 : mx3;
  }
  for (; k + kLanes <= n; k += kLanes) {
    const vf x = Io<T>::load(z + b0 + k);
    if constexpr (kWiden) vstore(sc + b0 + k, x);
    mx0 = x > mx0 ? x : mx0;
  }
  mx0 = mx1 > mx0 ? mx1 : mx0;
  mx2 = mx3 > mx2 ? mx3 : mx2;
  const vf vmax = mx2 > mx0 ? mx2 : mx0;
  float bm = hmax(vmax);
  for (; k < n; ++k) {
    const float x = Io<T>::scalar(z + b0 + k);
    if constexpr (kWiden) sc[b0 + k] = x;
    bm = x > bm ? x : bm;
  }
  if (bm > m) {
    s = m == -std::numeric_limits<float>::infinity() ? 0.0
                                                     : s * std::exp(static_cast<double>(m) - bm);
    m = bm;
  }
  block_max = m;
  const vf vm = splat(m);
  vf vs = splat(0.0f), vs1 = splat(0.0f);
  k = 0;
  for (; k + 2 * kLanes <= n; k += 2 * kLanes) {
    const vf e0 = vexp(vload(src + b0 + k) - vm), e1 = vexp(vload(src + b0 + k + kLanes) - vm);
    vstore(sc + b0 + k, e0);
    vstore(sc + b0 + k + kLanes, e1);
    vs += e0;
    vs1 += e1;
  }
  for (; k + kLanes <= n; k += kLanes) {
    const vf e = vexp(vload(src + b0 + k) - vm);
    vstore(sc + b0 + k, e);
    vs += e;
  }
  float bs = hsum(vs) + hsum(vs1);
  for (; k < n; ++k) {
    const float e = std::exp(src[b0 + k] - m);
    sc[b0 + k] = e;
    bs += e;
  }
  s += bs;
}

// A row's one pass over its blocks: pass 1 of block blk (the running maximum m and sum s carried
// from block to block) and pass 2 of the same block of the previous row.
template <typename T>
void run_rows(const XentArgs& a, int64_t begin, int64_t end) {
  const int64_t v = a.vocab, blocks = (v + kBlock - 1) / kBlock;
  // Two scratches: row r's first pass fills one while row r-1's gradient streams out of the
  // other, block by block, so that the stores overlap the exponentials instead of following them.
  const int64_t stride = v + blocks + 2 * kLanes;
  struct Scratch {
    float* p;
    ~Scratch() { std::free(p); }
  };
  const Scratch scratch{
      static_cast<float*>(std::malloc(static_cast<std::size_t>(2 * stride) * sizeof(float)))};
  if (scratch.p == nullptr) throw std::bad_alloc();
  T* grad = static_cast<T*>(a.grad);
  PendingRow<T> pending;
  int which = 0;
  for (int64_t row = begin; row < end; ++row) {
    T* g = grad != nullptr ? grad + row * v : nullptr;
    if (a.active != nullptr && !a.active[row]) {
      a.lse[row] = 0.0f;
      a.token_loss[row] = 0.0f;
      if (g != nullptr)
        std::memset(static_cast<void*>(g), 0, static_cast<std::size_t>(v) * sizeof(T));
      continue;
    }
    float* sc = scratch.p + which * stride;
    float* block_max = sc + v + kLanes;
    const T* z = static_cast<const T*>(a.logits) + row * a.row_stride;
    // Pass 1: online log-sum-exp, one read of the logits.
    float m = -std::numeric_limits<float>::infinity();
    double s = 0.0;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t b0 = blk * kBlock, n = min64(kBlock, v - b0);
      // Once the running maximum m is finite, a block takes one sweep; else, or when its maximum
      // rises too far, two.
      if (!(m > -std::numeric_limits<float>::infinity() &&
            sum_block_one_sweep(z, sc, b0, n, m, s, block_max[blk])))
        sum_block_two_sweeps(z, sc, b0, n, m, s, block_max[blk]);
      if (pending.g != nullptr) grad_block(pending, blk, v, blocks);
    }
    pending.g = nullptr;
    const double lse = static_cast<double>(m) + std::log(s);
    const int64_t y = a.targets[row];
    const double zy = Io<T>::scalar(z + y);
    a.lse[row] = static_cast<float>(lse);
    a.token_loss[row] = static_cast<float>(lse - zy);
    if (g == nullptr) continue;
    const float c = a.grad_scale[row];
    if (c == 0.0f) {
      std::memset(static_cast<void*>(g), 0, static_cast<std::size_t>(v) * sizeof(T));
      continue;
    }
    pending = PendingRow<T>{g, sc, block_max, lse, zy, c, y};
    which ^= 1;
  }
  if (pending.g != nullptr) {
    for (int64_t blk = 0; blk < blocks; ++blk) grad_block(pending, blk, v, blocks);
  }
  stream_fence();
}

}  // namespace

void xent_rows(const XentArgs& a, int64_t begin, int64_t end) {
  switch (a.dtype) {
    case DType::kFloat16:
      return run_rows<HalfBits>(a, begin, end);
    case DType::kBFloat16:
      return run_rows<BFloat16Bits>(a, begin, end);
    default:
      return run_rows<float>(a, begin, end);
  }
}

}  // namespace lossguard::kernels::LOSSGUARD_XENT_ISA
