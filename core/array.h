// A typed, contiguous, row-major host array that may borrow memory (an mmap'd safetensors file, a
// zip record): the one tensor type shared by loaders, the oracle and the trainer, free of LibTorch.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lossguard {

enum class DType {
  kBool,
  kUInt8,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64
};

std::string_view dtype_name(DType dtype);  // "int64", "bfloat16", ...
std::size_t dtype_size_bytes(DType dtype);
bool dtype_is_float(DType dtype);
// The number of ones among n bytes that are each 0 or 1 (a loss mask), eight at a time: one
// multiply-and-shift sums a word's eight bytes (their sum, at most 8, fits the top byte).
inline int64_t count_mask_ones(const uint8_t* p, int64_t n) {
  int64_t sum = 0, j = 0;
  for (; j + 8 <= n; j += 8) {
    uint64_t w;
    std::memcpy(&w, p + j, 8);
    sum += static_cast<int64_t>((w * 0x0101010101010101ull) >> 56);
  }
  for (; j < n; ++j) sum += p[j];
  return sum;
}
// Whether `dtype` holds the value exactly (bfloat16, float16; every value for the others): every
// value a trainer computing in bf16 records is one, though written widened to float32.
bool dtype_holds(DType dtype, double value);
bool parse_dtype(std::string_view name,
                 DType* out);  // accepts lossguard names and safetensors codes

float half_to_float(uint16_t bits);
float bfloat16_to_float(uint16_t bits);
uint16_t float_to_half(float value);      // round to nearest even
uint16_t float_to_bfloat16(float value);  // round to nearest even

struct HostArray {
  DType dtype = DType::kFloat32;
  std::vector<int64_t> shape;
  std::shared_ptr<const void> owner;  // keeps `data` alive
  const std::byte* data = nullptr;
  // `data` is a read-only view of a memory-mapped file large enough that a pass over it drops the
  // pages it read (they are read from the file again if needed), so GiBs of logits never stay
  // resident (io/safetensors.cpp decides: over a quarter of the machine's memory).
  bool file_backed = false;

  int64_t numel() const;
  std::size_t size_bytes() const {
    return static_cast<std::size_t>(numel()) * dtype_size_bytes(dtype);
  }
  std::string shape_string() const;  // "[3, 4]"

  double get_f64(int64_t flat_index) const;   // any dtype, exact for floats and ints below 2^53
  int64_t get_i64(int64_t flat_index) const;  // integer and bool dtypes; floats truncated
  // Bulk forms of the two above (the dtype switch outside the loop), for elements [start, start +
  // n).
  void copy_i64(int64_t start, int64_t n, int64_t* dst) const;
  void copy_f64(int64_t start, int64_t n, double* dst) const;
  // Whether elements [begin, end) of a float array hold a NaN or an infinity (a test of the
  // exponent bits, vectorised; an unknown float layout answers true, for an exact look). False for
  // integer dtypes.
  bool any_non_finite(int64_t begin, int64_t end) const;
  // A file-backed array may give back the pages of elements [begin, end) once read (madvise
  // MADV_DONTNEED on a private read-only mapping: touched again, they are read from the file); a
  // no-op for arrays in memory. A pass over GiBs of logits then keeps only its window resident.
  void drop_pages(int64_t begin, int64_t end) const;

  // Fresh arrays owning their memory.
  static HostArray zeros(DType dtype, std::vector<int64_t> shape);
  static HostArray from_f64(DType dtype, std::vector<int64_t> shape,
                            const std::vector<double>& values);
  static HostArray from_i64(DType dtype, std::vector<int64_t> shape,
                            const std::vector<int64_t>& values);
  std::byte* mutable_data() { return const_cast<std::byte*>(data); }  // only for arrays made above
};

}  // namespace lossguard
