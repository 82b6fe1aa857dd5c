// HostArray element access and the half/bfloat16 conversions (bit-exact, no LibTorch).
#include "core/array.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>

#include "core/errors.h"

namespace lossguard {

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBool:
      return "bool";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt8:
      return "int8";
    case DType::kInt16:
      return "int16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
  }
  return "?";
}

std::size_t dtype_size_bytes(DType dtype) {
  switch (dtype) {
    case DType::kBool:
    case DType::kUInt8:
    case DType::kInt8:
      return 1;
    case DType::kInt16:
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
    case DType::kFloat32:
      return 4;
    case DType::kInt64:
    case DType::kFloat64:
      return 8;
  }
  return 0;
}

bool dtype_is_float(DType dtype) {
  return dtype == DType::kFloat16 || dtype == DType::kBFloat16 || dtype == DType::kFloat32 ||
         dtype == DType::kFloat64;
}

bool parse_dtype(std::string_view name, DType* out) {
  struct Entry {
    std::string_view a, b;
    DType d;
  };
  static const Entry kNames[] = {
      {"bool", "BOOL", DType::kBool},      {"uint8", "U8", DType::kUInt8},
      {"int8", "I8", DType::kInt8},        {"int16", "I16", DType::kInt16},
      {"int32", "I32", DType::kInt32},     {"int64", "I64", DType::kInt64},
      {"float16", "F16", DType::kFloat16}, {"bfloat16", "BF16", DType::kBFloat16},
      {"float32", "F32", DType::kFloat32}, {"float64", "F64", DType::kFloat64},
      {"fp16", "half", DType::kFloat16},   {"bf16", "bf16", DType::kBFloat16},
      {"fp32", "float", DType::kFloat32},  {"fp64", "double", DType::kFloat64},
  };
  for (const auto& e : kNames) {
    if (name == e.a || name == e.b) {
      *out = e.d;
      return true;
    }
  }
  return false;
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    bits |= sign;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  uint32_t bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  std::memcpy(&f, &bits, 4);
  return f;
}

float bfloat16_to_float(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  const uint32_t rounding_bias = 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

uint16_t float_to_half(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const float a = std::fabs(value);
  if (std::isnan(value)) return sign | 0x7e00;
  if (a >= 65520.0f) return sign | 0x7c00;  // rounds to infinity
  if (a < 6.103515625e-05f) {               // subnormal half: multiples of 2^-24
    const float scaled = std::nearbyint(a * 16777216.0f);
    return sign | static_cast<uint16_t>(scaled);
  }
  int exp;
  const float m = std::frexp(a, &exp);  // a = m * 2^exp, m in [0.5, 1)
  // mantissa with 10 explicit bits: a = (1 + f/1024) * 2^(exp-1)
  float frac = std::nearbyint((m * 2.0f - 1.0f) * 1024.0f);
  int e = exp - 1;
  if (frac >= 1024.0f) {
    frac = 0.0f;
    ++e;
  }
  if (e > 15) return sign | 0x7c00;
  return sign | static_cast<uint16_t>(((e + 15) << 10) | static_cast<uint16_t>(frac));
}

int64_t HostArray::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string HostArray::shape_string() const { return fmt::format("[{}]", fmt::join(shape, ", ")); }

double HostArray::get_f64(int64_t i) const {
  const std::byte* p = data + static_cast<std::size_t>(i) * dtype_size_bytes(dtype);
  switch (dtype) {
    case DType::kFloat16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return half_to_float(v);
    }
    case DType::kBFloat16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return bfloat16_to_float(v);
    }
    case DType::kFloat32: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::kFloat64: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    default:
      return static_cast<double>(get_i64(i));
  }
}

int64_t HostArray::get_i64(int64_t i) const {
  const std::byte* p = data + static_cast<std::size_t>(i) * dtype_size_bytes(dtype);
  switch (dtype) {
    case DType::kBool:
    case DType::kUInt8:
      return static_cast<int64_t>(std::to_integer<uint8_t>(*p));
    case DType::kInt8:
      return static_cast<int64_t>(static_cast<int8_t>(std::to_integer<uint8_t>(*p)));
    case DType::kInt16: {
      int16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    case DType::kInt32: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::kInt64: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return v;
    }
    default:
      return static_cast<int64_t>(get_f64(i));
  }
}

namespace {
template <typename T, typename Out>
void copy_as(const std::byte* base, int64_t start, int64_t n, Out* dst) {
  const std::byte* p = base + static_cast<std::size_t>(start) * sizeof(T);
  for (int64_t k = 0; k < n; ++k) {
    T v;
    std::memcpy(&v, p + static_cast<std::size_t>(k) * sizeof(T), sizeof(T));
    dst[k] = static_cast<Out>(v);
  }
}
}  // namespace

void HostArray::copy_i64(int64_t start, int64_t n, int64_t* dst) const {
  if (n <= 0) return;
  switch (dtype) {
    case DType::kBool:
    case DType::kUInt8:
      copy_as<uint8_t>(data, start, n, dst);
      return;
    case DType::kInt8:
      copy_as<int8_t>(data, start, n, dst);
      return;
    case DType::kInt16:
      copy_as<int16_t>(data, start, n, dst);
      return;
    case DType::kInt32:
      copy_as<int32_t>(data, start, n, dst);
      return;
    case DType::kInt64:
      std::memcpy(dst, data + static_cast<std::size_t>(start) * 8, static_cast<std::size_t>(n) * 8);
      return;
    default:
      for (int64_t k = 0; k < n; ++k) dst[k] = get_i64(start + k);
  }
}

void HostArray::copy_f64(int64_t start, int64_t n, double* dst) const {
  if (n <= 0) return;
  switch (dtype) {
    case DType::kFloat32:
      copy_as<float>(data, start, n, dst);
      return;
    case DType::kFloat64:
      std::memcpy(dst, data + static_cast<std::size_t>(start) * 8, static_cast<std::size_t>(n) * 8);
      return;
    case DType::kInt64:
      copy_as<int64_t>(data, start, n, dst);
      return;
    case DType::kInt32:
      copy_as<int32_t>(data, start, n, dst);
      return;
    case DType::kBool:
    case DType::kUInt8:
      copy_as<uint8_t>(data, start, n, dst);
      return;
    case DType::kBFloat16: {  // the upper half of a float's bits: a shift (vectorised)
      const uint16_t* p = reinterpret_cast<const uint16_t*>(data) + start;
      for (int64_t k = 0; k < n; ++k) {
        const uint32_t bits = static_cast<uint32_t>(p[k]) << 16;
        float f;
        std::memcpy(&f, &bits, 4);
        dst[k] = f;
      }
      return;
    }
    case DType::kFloat16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(data) + start;
      for (int64_t k = 0; k < n; ++k) dst[k] = half_to_float(p[k]);
      return;
    }
    default:
      for (int64_t k = 0; k < n; ++k) dst[k] = get_f64(start + k);
  }
}

namespace {

// An all-ones exponent, tested on the bits of each element.
template <typename U>
bool any_non_finite_bits(const std::byte* data, int64_t begin, int64_t end, U exponent) {
  const U* p = reinterpret_cast<const U*>(data);
  U hit = 0;
  for (int64_t k = begin; k < end; ++k) hit |= static_cast<U>((p[k] & exponent) == exponent);
  return hit != 0;
}

}  // namespace

bool HostArray::any_non_finite(int64_t begin, int64_t end) const {
  if (end <= begin || !dtype_is_float(dtype)) return false;
  switch (dtype) {
    case DType::kBFloat16:
      return any_non_finite_bits<uint16_t>(data, begin, end, 0x7f80);
    case DType::kFloat16:
      return any_non_finite_bits<uint16_t>(data, begin, end, 0x7c00);
    case DType::kFloat32:
      return any_non_finite_bits<uint32_t>(data, begin, end, 0x7f800000u);
    case DType::kFloat64:
      return any_non_finite_bits<uint64_t>(data, begin, end, 0x7ff0000000000000ull);
    default:
      return true;
  }
}

void HostArray::drop_pages(int64_t begin, int64_t end) const {
  if (!file_backed || end <= begin) return;
  const std::size_t e = dtype_size_bytes(dtype);
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto lo = (reinterpret_cast<uintptr_t>(data + begin * e) + page - 1) / page * page;
  const auto hi = reinterpret_cast<uintptr_t>(data + end * e) / page * page;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

HostArray HostArray::zeros(DType dtype, std::vector<int64_t> shape) {
  HostArray a;
  a.dtype = dtype;
  a.shape = std::move(shape);
  auto buf = std::make_shared<std::vector<std::byte>>(std::max<std::size_t>(a.size_bytes(), 1));
  a.data = buf->data();
  a.owner = buf;
  return a;
}

HostArray HostArray::from_f64(DType dtype, std::vector<int64_t> shape,
                              const std::vector<double>& values) {
  HostArray a = zeros(dtype, std::move(shape));
  LG_CHECK(static_cast<int64_t>(values.size()) == a.numel(), "{} values for shape {}",
           values.size(), a.shape_string());
  std::byte* p = a.mutable_data();
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    switch (dtype) {
      case DType::kFloat16: {
        uint16_t h = float_to_half(static_cast<float>(v));
        std::memcpy(p + 2 * i, &h, 2);
        break;
      }
      case DType::kBFloat16: {
        uint16_t h = float_to_bfloat16(static_cast<float>(v));
        std::memcpy(p + 2 * i, &h, 2);
        break;
      }
      case DType::kFloat32: {
        float f = static_cast<float>(v);
        std::memcpy(p + 4 * i, &f, 4);
        break;
      }
      case DType::kFloat64:
        std::memcpy(p + 8 * i, &v, 8);
        break;
      default:
        LG_CHECK(false, "from_f64 needs a float dtype, got {}", dtype_name(dtype));
    }
  }
  return a;
}

HostArray HostArray::from_i64(DType dtype, std::vector<int64_t> shape,
                              const std::vector<int64_t>& values) {
  HostArray a = zeros(dtype, std::move(shape));
  LG_CHECK(static_cast<int64_t>(values.size()) == a.numel(), "{} values for shape {}",
           values.size(), a.shape_string());
  std::byte* p = a.mutable_data();
  for (std::size_t i = 0; i < values.size(); ++i) {
    const int64_t v = values[i];
    switch (dtype) {
      case DType::kBool:
      case DType::kUInt8:
      case DType::kInt8: {
        auto b = static_cast<uint8_t>(v);
        std::memcpy(p + i, &b, 1);
        break;
      }
      case DType::kInt16: {
        auto s = static_cast<int16_t>(v);
        std::memcpy(p + 2 * i, &s, 2);
        break;
      }
      case DType::kInt32: {
        auto s = static_cast<int32_t>(v);
        std::memcpy(p + 4 * i, &s, 4);
        break;
      }
      case DType::kInt64:
        std::memcpy(p + 8 * i, &v, 8);
        break;
      default:
        LG_CHECK(false, "from_i64 needs an integer dtype, got {}", dtype_name(dtype));
    }
  }
  return a;
}

bool dtype_holds(DType dtype, double v) {
  if (!std::isfinite(v) || v == 0.0) return true;
  int e = 0;
  const double m = std::frexp(std::fabs(v), &e);  // |v| = m·2^e, 0.5 <= m < 1
  auto fits = [&](int bits) { return std::ldexp(m, bits) == std::floor(std::ldexp(m, bits)); };
  switch (dtype) {
    case DType::kBFloat16:  // 8 significant bits; float32's exponent range
      return std::fabs(v) <= 3.3895313892515355e38 &&
             (e - 1 >= -126
                  ? fits(8)
                  : std::ldexp(std::fabs(v), 133) == std::floor(std::ldexp(std::fabs(v), 133)));
    case DType::kFloat16:  // 11 significant bits, normal from 2^-14, subnormal steps of 2^-24
      return std::fabs(v) <= 65504.0 &&
             (e - 1 >= -14
                  ? fits(11)
                  : std::ldexp(std::fabs(v), 24) == std::floor(std::ldexp(std::fabs(v), 24)));
    default:
      return true;
  }
}

}  // namespace lossguard
