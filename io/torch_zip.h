// torch.save archives (zip format): read through LibTorch's zip reader and the restricted
// unpickler, and written (for `gen`) through LibTorch's zip writer. The only io file that includes
// LibTorch.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "core/array.h"
#include "io/value.h"

namespace lossguard::io {

// Reads `path` into a Value tree. Tensors copy their storage out of the archive once (shared
// storages are read once). Throws InputError for a non-zip or TorchScript file, a malformed archive
// or pickle, or a pickle that names a dangerous global.
ValuePtr read_torch_save(const std::string& path);

// Writes a dict {key: tensor | int | float | str} that `torch.load(path)` reads back.
struct TorchSaveEntry {
  std::string key;
  ValuePtr value;  // kTensor, kInt, kFloat, kString, kBool or kNone
};
void write_torch_save(const std::string& path, const std::vector<TorchSaveEntry>& entries);

// The archive layout torch.save uses: data.pkl, byteorder and data/<k> for storage k (whose
// persistent ids in `pickle` use the keys "0", "1", ...). For writers of hand-made pickles (tests,
// fuzzers).
void write_torch_archive(const std::string& path, const std::string& pickle,
                         const std::vector<const HostArray*>& storages);

}  // namespace lossguard::io
