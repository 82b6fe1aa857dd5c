// NCCL found and loaded at run time (core/nccl_library.h).
#include "core/nccl_library.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>

#include "core/errors.h"

namespace lossguard {

namespace fs = std::filesystem;

namespace {

// <prefix>/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2, every Python version present.
void add_wheel_copies(const std::string& prefix, std::vector<std::string>& out) {
  std::error_code ec;
  const fs::path lib = fs::path(prefix) / "lib";
  if (!fs::is_directory(lib, ec)) return;
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(lib, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("python3", 0) != 0) continue;
    const fs::path so = entry.path() / "site-packages" / "nvidia" / "nccl" / "lib" / "libnccl.so.2";
    if (fs::exists(so, ec)) found.push_back(so.string());
  }
  std::sort(found.begin(), found.end());
  out.insert(out.end(), found.begin(), found.end());
}

}  // namespace

std::vector<std::string> nccl_candidates(const std::string& env_library,
                                         const std::vector<std::string>& prefixes) {
  std::vector<std::string> out;
  if (!env_library.empty()) out.push_back(env_library);
  out.push_back("libnccl.so.2");
  for (const auto& p : prefixes)
    if (!p.empty()) add_wheel_copies(p, out);
  return out;
}

NcclLibrary load_nccl(const std::vector<std::string>& candidates, const std::string& what) {
  std::string errors;
  for (const auto& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (handle == nullptr) {
      errors += std::string("\n  ") + dlerror();
      continue;
    }
    NcclLibrary lib{handle, path};
    if (path.find('/') == std::string::npos) {  // found on the loader's path: name the file
      Dl_info info{};
      if (void* sym = dlsym(handle, "ncclGetVersion");
          sym != nullptr && dladdr(sym, &info) != 0 && info.dli_fname != nullptr)
        lib.path = info.dli_fname;
    }
    return lib;
  }
  throw InputError(what +
                   " needs NCCL, which was not found (pip install nvidia-nccl-cu12 in the active "
                   "environment, or set LOSSGUARD_NCCL_LIBRARY to a libnccl.so.2); tried:" +
                   errors);
}

const NcclLibrary& nccl_library(const std::string& what) {
  static std::mutex mutex;
  static std::optional<NcclLibrary> loaded;
  static std::string
      failure;  // the message after the first caller's `what`: each caller names itself
  std::lock_guard<std::mutex> lock(mutex);
  if (!loaded && failure.empty()) {
    std::vector<std::string> prefixes;
    for (const char* var : {"VIRTUAL_ENV", "CONDA_PREFIX"})
      if (const char* v = std::getenv(var); v != nullptr) prefixes.emplace_back(v);
    std::error_code ec;
    const auto exe = fs::read_symlink("/proc/self/exe", ec);
    if (!ec) prefixes.push_back(exe.parent_path().parent_path().string());
    const char* env = std::getenv("LOSSGUARD_NCCL_LIBRARY");
    try {
      loaded = load_nccl(nccl_candidates(env != nullptr ? env : "", prefixes), what);
    } catch (const InputError& e) {
      failure = std::string(e.what()).substr(what.size());
    }
  }
  if (!loaded) throw InputError(what + failure);
  return *loaded;
}

void* nccl_symbol(const NcclLibrary& lib, const char* name) {
  void* sym = dlsym(lib.handle, name);
  if (sym == nullptr)
    throw InputError(std::string("NCCL at ") + lib.path + " has no " + name +
                     " (too old a release?)");
  return sym;
}

}  // namespace lossguard
