// Finds and loads liblossguard_torchzip.so once per process.
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>

#include "io/zip_plugin.h"
#include "lossguard/build_config.h"
#include "oracle/errors.h"

namespace lossguard::io {

const TorchZipApi& torch_zip_api() {
  static const TorchZipApi* api = nullptr;
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("LOSSGUARD_TORCHZIP");
    std::vector<std::string> candidates;
    if (env != nullptr && *env != '\0') candidates.push_back(env);
    candidates.push_back(LOSSGUARD_TORCHZIP_PLUGIN);  // the build tree
    std::string errors;
    for (const auto& path : candidates) {
      void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) {
        errors += std::string("\n  ") + dlerror();
        continue;
      }
      auto fn = reinterpret_cast<const TorchZipApi* (*)()>(dlsym(handle, "lossguard_torchzip_api"));
      if (fn != nullptr && fn()->abi_version == kTorchZipAbiVersion) {
        api = fn();
        return;
      }
      errors += "\n  " + path + ": not a matching lossguard plugin";
    }
    failure = "cannot load LibTorch's zip reader (liblossguard_torchzip.so), needed for torch.save files; set "
              "LOSSGUARD_TORCHZIP to its path:" + errors;
  });
  if (api == nullptr) throw InputError(failure);
  return *api;
}

}  // namespace lossguard::io
