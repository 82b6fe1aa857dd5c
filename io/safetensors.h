// safetensors: memory-mapped reading with the format's validation rules, and writing.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/array.h"

namespace lossguard::io {

inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;  // the format's own cap

struct SafetensorsFile {
  std::vector<std::pair<std::string, HostArray>> tensors;  // in file order (by data offset)
  std::map<std::string, std::string> metadata;             // __metadata__
};

// Maps `path` and validates header size, JSON, dtypes, shapes, offsets (contiguous, in bounds,
// equal to shape x dtype size) and names (no duplicates). Tensors borrow the mapping. Throws
// InputError.
SafetensorsFile read_safetensors(const std::string& path);
// The same checks on bytes already in memory (`owner` keeps them alive); `what` names them in
// errors.
SafetensorsFile parse_safetensors(std::shared_ptr<const void> owner, const std::byte* bytes,
                                  uint64_t size, const std::string& what);

void write_safetensors(const std::string& path,
                       const std::vector<std::pair<std::string, HostArray>>& tensors,
                       const std::map<std::string, std::string>& metadata);

}  // namespace lossguard::io
