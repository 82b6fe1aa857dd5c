// safetensors reader (mmap) and writer. Layout: u64 little-endian header size N, N bytes of JSON
// header, then the data buffer; every tensor's data_offsets are relative to the buffer.
#include "io/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/errors.h"

namespace lossguard::io {

namespace {

struct Mapping {
  void* addr = nullptr;
  std::size_t size = 0;
  ~Mapping() {
    if (addr != nullptr && addr != MAP_FAILED) munmap(addr, size);
  }
};

const char* safetensors_code(DType d) {
  switch (d) {
    case DType::kBool:
      return "BOOL";
    case DType::kUInt8:
      return "U8";
    case DType::kInt8:
      return "I8";
    case DType::kInt16:
      return "I16";
    case DType::kInt32:
      return "I32";
    case DType::kInt64:
      return "I64";
    case DType::kFloat16:
      return "F16";
    case DType::kBFloat16:
      return "BF16";
    case DType::kFloat32:
      return "F32";
    case DType::kFloat64:
      return "F64";
  }
  return "?";
}

}  // namespace

SafetensorsFile read_safetensors(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) throw_input_error("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    ::close(fd);
    throw_input_error("{}: cannot stat: {}", path, std::strerror(errno));
  }
  const auto file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) {
    ::close(fd);
    throw_input_error("{}: safetensors file of {} bytes is shorter than its 8-byte header size",
                      path, file_size);
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->size = file_size;
  mapping->addr = mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (mapping->addr == MAP_FAILED)
    throw_input_error("{}: cannot map: {}", path, std::strerror(errno));
  return parse_safetensors(mapping, static_cast<const std::byte*>(mapping->addr), file_size, path);
}

namespace {

// The header's length N from the first 8 bytes (little-endian), checked against the format's cap
// and the file's size.
uint64_t header_size_of(const std::byte* base, uint64_t file_size, const std::string& path) {
  uint64_t header_size = 0;
  for (int k = 0; k < 8; ++k)
    header_size |= static_cast<uint64_t>(std::to_integer<uint8_t>(base[k])) << (8 * k);
  if (header_size > kSafetensorsMaxHeaderBytes) {
    throw_input_error("{}: safetensors header of {} bytes exceeds the format's cap of {} bytes",
                      path, header_size, kSafetensorsMaxHeaderBytes);
  }
  if (header_size > file_size - 8) {
    throw_input_error(
        "{}: safetensors header claims {} bytes but the file has {} after the size field "
        "(truncated?)",
        path, header_size, file_size - 8);
  }
  return header_size;
}

// The header's JSON: an object that names no tensor twice.
nlohmann::json parse_header(std::string_view header, const std::string& path) {
  if (header.empty() || header.front() != '{') {
    throw_input_error("{}: safetensors header does not start with '{{'", path);
  }
  std::set<std::string> seen;
  std::string duplicate;
  nlohmann::json::parser_callback_t on_key = [&](int depth, nlohmann::json::parse_event_t ev,
                                                 nlohmann::json& j) {
    if (depth == 1 && ev == nlohmann::json::parse_event_t::key) {
      const std::string k = j.get<std::string>();
      if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
    }
    return true;
  };
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(header, on_key);
  } catch (const nlohmann::json::exception& e) {
    throw_input_error("{}: safetensors header is not valid JSON: {}", path, e.what());
  }
  if (!doc.is_object()) throw_input_error("{}: safetensors header is not a JSON object", path);
  if (!duplicate.empty())
    throw_input_error("{}: safetensors header names tensor '{}' twice", path, duplicate);
  return doc;
}

// __metadata__: an object of strings.
void read_metadata(const nlohmann::json& info, const std::string& path,
                   std::map<std::string, std::string>& metadata) {
  if (!info.is_object()) throw_input_error("{}: __metadata__ is not an object", path);
  for (auto m = info.begin(); m != info.end(); ++m) {
    if (!m.value().is_string())
      throw_input_error("{}: __metadata__['{}'] is not a string", path, m.key());
    metadata[m.key()] = m.value().get<std::string>();
  }
}

// Where a tensor's bytes lie in the data buffer, [begin, end).
struct TensorSpan {
  uint64_t begin, end;
  std::string name;
};

// One tensor's header entry: its dtype and shape into `a`, its data_offsets checked against them
// and against the data buffer of data_size bytes.
TensorSpan read_tensor_entry(const std::string& name, const nlohmann::json& info,
                             uint64_t data_size, const std::string& path, HostArray& a) {
  if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") ||
      !info.contains("data_offsets")) {
    throw_input_error("{}: tensor '{}': header entry needs dtype, shape and data_offsets", path,
                      name);
  }
  const auto& dt = info["dtype"];
  if (!dt.is_string() || !parse_dtype(dt.get<std::string>(), &a.dtype)) {
    throw_input_error("{}: tensor '{}': unsupported dtype {}", path, name, dt.dump());
  }
  const auto& shape = info["shape"];
  if (!shape.is_array()) throw_input_error("{}: tensor '{}': shape is not a list", path, name);
  uint64_t numel = 1;
  for (const auto& d : shape) {
    if (!d.is_number_unsigned())
      throw_input_error("{}: tensor '{}': shape {} has a non-natural entry", path, name,
                        shape.dump());
    const uint64_t dim = d.get<uint64_t>();
    if (dim != 0 && numel > (uint64_t{1} << 62) / dim)
      throw_input_error("{}: tensor '{}': shape {} overflows", path, name, shape.dump());
    numel *= dim;
    a.shape.push_back(static_cast<int64_t>(dim));
  }
  const auto& off = info["data_offsets"];
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned()) {
    throw_input_error("{}: tensor '{}': data_offsets must be two natural numbers, got {}", path,
                      name, off.dump());
  }
  const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
  if (begin > end)
    throw_input_error("{}: tensor '{}': data_offsets [{}, {}] are reversed", path, name, begin,
                      end);
  if (end > data_size) {
    throw_input_error(
        "{}: tensor '{}': data_offsets [{}, {}] run past the data buffer of {} bytes (truncated "
        "file?)",
        path, name, begin, end, data_size);
  }
  const uint64_t want = numel * dtype_size_bytes(a.dtype);
  if (end - begin != want) {
    throw_input_error(
        "{}: tensor '{}': data_offsets [{}, {}] hold {} bytes but shape {} x {} needs {}", path,
        name, begin, end, end - begin, a.shape_string(), dtype_name(a.dtype), want);
  }
  return {begin, end, name};
}

// The spans' order by offset, once checked to cover the buffer of data_size bytes exactly, in
// order, with no gap and no overlap.
std::vector<std::size_t> covering_order(const std::vector<TensorSpan>& spans, uint64_t data_size,
                                        const std::string& path) {
  std::vector<std::size_t> order(spans.size());
  for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
    return spans[x].begin != spans[y].begin ? spans[x].begin < spans[y].begin
                                            : spans[x].end < spans[y].end;
  });
  uint64_t cursor = 0;
  for (std::size_t k : order) {
    if (spans[k].begin < cursor) {
      throw_input_error(
          "{}: tensor '{}': data_offsets [{}, {}] overlap the previous tensor (ends at {})", path,
          spans[k].name, spans[k].begin, spans[k].end, cursor);
    }
    if (spans[k].begin > cursor) {
      throw_input_error("{}: tensor '{}': data_offsets start at {} leaving a gap after byte {}",
                        path, spans[k].name, spans[k].begin, cursor);
    }
    cursor = spans[k].end;
  }
  if (cursor != data_size) {
    throw_input_error("{}: the tensors cover {} bytes of a {}-byte data buffer (trailing bytes)",
                      path, cursor, data_size);
  }
  return order;
}

}  // namespace

// The safetensors header checked in the format's order (length, JSON, each tensor's dtype, shape
// and offsets, overlaps, the file's size), each error naming the file and the tensor.
SafetensorsFile parse_safetensors(std::shared_ptr<const void> mapping, const std::byte* base,
                                  uint64_t file_size, const std::string& path) {
  // A pass over a mapped dump gives back the pages it read (HostArray::drop_pages) only when the
  // dump is over a quarter of the machine's memory: a smaller one stays mapped (clean pages the
  // kernel may reclaim at will), and the next pass over it faults nothing in: check's three passes
  // over a 1.3 GB dump spent 0.4 s of system time re-reading it, and the unmapping's TLB flushes.
  static const uint64_t quarter_of_memory = static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) *
                                            static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) / 4;
  const bool gives_back_pages = file_size > quarter_of_memory;
  if (file_size < 8) {
    throw_input_error("{}: safetensors file of {} bytes is shorter than its 8-byte header size",
                      path, file_size);
  }
  const uint64_t header_size = header_size_of(base, file_size, path);
  const nlohmann::json doc =
      parse_header(std::string_view(reinterpret_cast<const char*>(base + 8), header_size), path);

  const uint64_t data_size = file_size - 8 - header_size;
  const std::byte* data = base + 8 + header_size;
  SafetensorsFile out;
  std::vector<TensorSpan> spans;
  for (auto it = doc.begin(); it != doc.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      read_metadata(it.value(), path, out.metadata);
      continue;
    }
    HostArray a;
    spans.push_back(read_tensor_entry(name, it.value(), data_size, path, a));
    a.owner = mapping;
    a.data = data + spans.back().begin;
    a.file_backed = gives_back_pages;
    out.tensors.emplace_back(name, std::move(a));
  }
  const std::vector<std::size_t> order = covering_order(spans, data_size, path);
  std::vector<std::pair<std::string, HostArray>> sorted;
  for (std::size_t k : order) {
    for (auto& t : out.tensors) {
      if (t.first == spans[k].name) sorted.push_back(t);
    }
  }
  out.tensors = std::move(sorted);
  return out;
}

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, HostArray>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const auto& [name, a] : tensors) {
    header[name] = {{"dtype", safetensors_code(a.dtype)},
                    {"shape", a.shape},
                    {"data_offsets", {offset, offset + a.size_bytes()}}};
    offset += a.size_bytes();
  }
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) throw_input_error("{}: cannot write: {}", path, std::strerror(errno));
  const uint64_t n = text.size();
  char size_bytes[8];
  for (int k = 0; k < 8; ++k) size_bytes[k] = static_cast<char>((n >> (8 * k)) & 0xff);
  f.write(size_bytes, 8);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& [name, a] : tensors)
    f.write(reinterpret_cast<const char*>(a.data), static_cast<std::streamsize>(a.size_bytes()));
  if (!f) throw_input_error("{}: write failed: {}", path, std::strerror(errno));
}

}  // namespace lossguard::io
