// Finds and loads liblossguard_torchzip.so once per process.
#include <mutex>

#include "io/plugin_loader.h"
#include "io/zip_plugin.h"
#include "lossguard/build_config.h"
#include "oracle/errors.h"

namespace lossguard::io {

const TorchZipApi& torch_zip_api() {
  static const TorchZipApi* api = nullptr;
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      api = static_cast<const TorchZipApi*>(load_plugin_table(
          "LibTorch's zip reader (liblossguard_torchzip.so), needed for torch.save files", "LOSSGUARD_TORCHZIP",
          LOSSGUARD_TORCHZIP_PLUGIN, "lossguard_torchzip_api", kTorchZipAbiVersion));
    } catch (const InputError& e) {
      failure = e.what();
    }
  });
  if (api == nullptr) throw InputError(failure);
  return *api;
}

}  // namespace lossguard::io
