// Finds and loads liblossguard_torchzip.so on first use.
#include "core/plugin_loader.h"
#include "io/zip_plugin.h"
#include "lossguard/build_config.h"
#include "lossguard/plugin_paths.h"

namespace lossguard::io {

const TorchZipApi& torch_zip_api() {
  return *static_cast<const TorchZipApi*>(load_plugin_table(
      "LibTorch's zip reader (liblossguard_torchzip.so), needed for torch.save files",
      "LOSSGUARD_TORCHZIP", LOSSGUARD_TORCHZIP_PLUGIN, "lossguard_torchzip_api",
      kTorchZipAbiVersion));
}

}  // namespace lossguard::io
