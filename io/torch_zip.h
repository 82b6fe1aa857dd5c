// torch.save archives (zip format): read through LibTorch's zip reader and the restricted unpickler,
// and written (for `gen`) through LibTorch's zip writer. The only io file that includes LibTorch.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "io/value.h"

namespace lossguard::io {

// Reads `path` into a Value tree. Tensors copy their storage out of the archive once (shared storages
// are read once). Throws InputError for a non-zip or TorchScript file, a malformed archive or pickle,
// or a pickle that names a dangerous global.
ValuePtr read_torch_save(const std::string& path);

// Writes a dict {key: tensor | int | float | str} that `torch.load(path)` reads back.
struct TorchSaveEntry {
  std::string key;
  ValuePtr value;  // kTensor, kInt, kFloat, kString, kBool or kNone
};
void write_torch_save(const std::string& path, const std::vector<TorchSaveEntry>& entries);

}  // namespace lossguard::io
