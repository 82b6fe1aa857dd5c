// dlopen-based plugin loading shared by the torch.save zip reader and the trainer.
#include "core/plugin_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <vector>

#include "core/errors.h"
#include "lossguard/build_config.h"

namespace lossguard {

namespace {

// "2.15" of "2.15.0+cu132".
std::string major_minor(const std::string& version) {
  const auto first = version.find('.');
  return version.substr(0, version.find_first_of(".+", first == std::string::npos ? 0 : first + 1));
}

// An installed copy's plugins find LibTorch in the torch of the Python environment they were
// installed in
// (<prefix>/lib/python3.*/site-packages/torch): what is there, when it cannot be the torch they
// were built with.
std::string torch_note(const std::filesystem::path& prefix) {
  const std::string built = LOSSGUARD_TORCH_VERSION;
  std::error_code ec;
  const std::regex assignment(R"(__version__\s*=\s*['"]([^'"]+)['"])");
  for (const auto& entry : std::filesystem::directory_iterator(prefix / "lib", ec)) {
    const auto name = entry.path().filename().string();
    if (name.rfind("python3", 0) != 0) continue;
    const auto version_py = entry.path() / "site-packages" / "torch" / "version.py";
    std::ifstream in(version_py);
    std::string line;
    std::smatch m;
    while (std::getline(in, line)) {
      if (!std::regex_search(line, m, assignment)) continue;
      if (major_minor(m[1]) == major_minor(built)) return "";
      return "\n  the plugins were built against torch " + built + "; this environment has torch " +
             m[1].str() + " (" + version_py.string() + "): install torch==" + major_minor(built) +
             ".* here, or build lossguard against this torch (pip install lossguard's sdist, or "
             "make wheel)";
    }
  }
  return "\n  no torch in " + (prefix / "lib" / "python3.*" / "site-packages").string() +
         ": the plugins load LibTorch from the Python environment lossguard is installed in (pip "
         "install torch==" +
         major_minor(built) + ".* there)";
}

const void* load_once(const std::string& what, const char* env_var, const std::string& default_path,
                      const char* symbol, int abi_version) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv(env_var); env != nullptr && *env != '\0')
    candidates.push_back(env);
  // An installed copy (cmake --install, the wheel) keeps its plugins in <prefix>/lib/lossguard
  // beside <prefix>/bin.
  const std::string name = std::filesystem::path(default_path).filename().string();
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  std::filesystem::path installed_prefix;
  if (!ec) {
    const auto installed = exe.parent_path().parent_path() / "lib" / "lossguard" / name;
    if (std::filesystem::exists(installed, ec)) {
      candidates.push_back(installed.string());
      installed_prefix = exe.parent_path().parent_path();
    }
  }
  // The build tree's copy only for a binary that is not installed: an installed one uses its own
  // plugins.
  if (installed_prefix.empty()) candidates.push_back(default_path);
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
  if (!installed_prefix.empty()) errors += torch_note(installed_prefix);
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
