// dlopen-based plugin loading shared by the torch.save zip reader and the trainer.
#include "io/plugin_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <vector>

#include "oracle/errors.h"

namespace lossguard::io {

const void* load_plugin_table(const std::string& what, const char* env_var, const std::string& default_path,
                              const char* symbol, int abi_version) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv(env_var); env != nullptr && *env != '\0') candidates.push_back(env);
  candidates.push_back(default_path);
  std::string errors;
  for (const auto& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      errors += std::string("\n  ") + dlerror();
      continue;
    }
    auto fn = reinterpret_cast<const int* (*)()>(dlsym(handle, symbol));
    if (fn != nullptr && *fn() == abi_version) return fn();  // every table starts with its abi_version
    errors += "\n  " + path + ": not a matching lossguard plugin (" + symbol + ")";
  }
  throw InputError("cannot load " + what + "; set " + env_var + " to its path:" + errors);
}

}  // namespace lossguard::io
