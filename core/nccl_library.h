// NCCL, loaded at run time by the commands that use it, never a load-time dependency of lossguard:
// a binary copied to a CPU runner, or to a GPU node whose NCCL comes from torch's wheel, starts and
// runs every other command.
#pragma once
#include <string>
#include <vector>

namespace lossguard {

struct NcclLibrary {
  void* handle = nullptr;
  std::string path;  // the file that loaded
};

// Where NCCL is looked for, in order: $LOSSGUARD_NCCL_LIBRARY (a file); `libnccl.so.2` on the
// dynamic loader's own path (LD_LIBRARY_PATH, the system's); the nvidia-nccl wheel
// (nvidia/nccl/lib) of each Python environment in reach — $VIRTUAL_ENV, $CONDA_PREFIX and the one
// lossguard is installed in (the folder above its bin/) — under lib/python3*/site-packages.
std::vector<std::string> nccl_candidates(const std::string& env_library,
                                         const std::vector<std::string>& prefixes);

// The first candidate that loads (RTLD_GLOBAL: a plugin linked against libnccl.so.2 then finds it).
// Throws InputError naming `what` needs NCCL and every place tried, with the fix.
NcclLibrary load_nccl(const std::vector<std::string>& candidates, const std::string& what);

// Once per process from the environment (nccl_candidates); a failure is remembered and thrown
// again.
const NcclLibrary& nccl_library(const std::string& what);

// A symbol of the loaded NCCL; throws InputError naming it and the library.
void* nccl_symbol(const NcclLibrary& lib, const char* name);

}  // namespace lossguard
