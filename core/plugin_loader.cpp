// dlopen-based plugin loading shared by the torch.save zip reader and the trainer.
#include "core/plugin_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <vector>

#include "core/errors.h"

namespace lossguard {

namespace {

const void* load_once(const std::string& what, const char* env_var, const std::string& default_path,
                      const char* symbol, int abi_version) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv(env_var); env != nullptr && *env != '\0')
    candidates.push_back(env);
  // An installed copy (cmake --install) keeps its plugins in <prefix>/lib/lossguard beside
  // <prefix>/bin.
  const std::string name = std::filesystem::path(default_path).filename().string();
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const auto installed = exe.parent_path().parent_path() / "lib" / "lossguard" / name;
    if (std::filesystem::exists(installed, ec)) candidates.push_back(installed.string());
  }
  candidates.push_back(default_path);
  std::string errors;
  for (const auto& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      errors += std::string("\n  ") + dlerror();
      continue;
    }
    auto fn = reinterpret_cast<const int* (*)()>(dlsym(handle, symbol));
    if (fn != nullptr && *fn() == abi_version)
      return fn();  // every table starts with its abi_version
    errors += "\n  " + path + ": not a matching lossguard plugin (" + symbol + ")";
  }
  throw InputError("cannot load " + what + "; set " + env_var + " to its path:" + errors);
}

}  // namespace

const void* load_plugin_table(const std::string& what, const char* env_var,
                              const std::string& default_path, const char* symbol,
                              int abi_version) {
  // Loaded once per process; a failure is remembered and reported again on every use.
  static std::mutex mutex;
  static std::map<std::string, std::pair<const void*, std::string>> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(symbol);
  if (it == loaded.end()) {
    std::pair<const void*, std::string> entry{nullptr, ""};
    try {
      entry.first = load_once(what, env_var, default_path, symbol, abi_version);
    } catch (const InputError& e) {
      entry.second = e.what();
    }
    it = loaded.emplace(symbol, entry).first;
  }
  if (it->second.first == nullptr) throw InputError(it->second.second);
  return it->second.first;
}

}  // namespace lossguard
