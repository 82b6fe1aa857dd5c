// Loading lossguard's LibTorch plugins (dlopen once per process): LibTorch's start-up costs ~0.2 s,
// so only the commands that need it (reading .pt files, `check`) load it.
#pragma once
#include <string>

namespace lossguard {

// Returns (and remembers, once per process) the table that `symbol` (an extern "C" function
// returning a pointer) gives, from the first of $env_var and `default_path` that loads and whose
// table starts with `abi_version`. Throws InputError naming `what` and every path tried.
const void* load_plugin_table(const std::string& what, const char* env_var,
                              const std::string& default_path, const char* symbol, int abi_version);

}  // namespace lossguard
