// core/nccl_library: where NCCL is looked for at run time, in what order, and what a user is told
// when it is nowhere. The load itself is tried on the machine's own libnccl.so.2, reached through a
// fake Python environment laid out as the nvidia-nccl wheel installs it.
#include "core/nccl_library.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.h"

namespace lossguard {
namespace {

namespace fs = std::filesystem;

fs::path temp_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / (name + "-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

fs::path wheel_copy(const fs::path& prefix, const std::string& python) {
  return prefix / "lib" / python / "site-packages" / "nvidia" / "nccl" / "lib" / "libnccl.so.2";
}

TEST(NcclLibrary, CandidatesAreTheVariableTheLoaderPathThenEachEnvironmentsWheel) {
  const fs::path venv = temp_dir("lossguard-nccl-venv");
  const fs::path conda = temp_dir("lossguard-nccl-conda");
  const std::vector<std::pair<fs::path, std::string>> installs = {
      {venv, "python3.12"}, {venv, "python3.10"}, {conda, "python3.11"}};
  for (const auto& [prefix, py] : installs) {
    fs::create_directories(wheel_copy(prefix, py).parent_path());
    std::ofstream(wheel_copy(prefix, py)) << "";
  }
  fs::create_directories(venv / "lib" / "python3.11" /
                         "site-packages");  // a Python without the wheel
  const std::vector<std::string> got = nccl_candidates(
      "/opt/nccl/libnccl.so.2", {venv.string(), "", (venv / "absent").string(), conda.string()});
  const std::vector<std::string> want = {
      "/opt/nccl/libnccl.so.2", "libnccl.so.2", wheel_copy(venv, "python3.10").string(),
      wheel_copy(venv, "python3.12").string(), wheel_copy(conda, "python3.11").string()};
  EXPECT_EQ(got, want);
  EXPECT_EQ(nccl_candidates("", {}), std::vector<std::string>{"libnccl.so.2"});
  fs::remove_all(venv);
  fs::remove_all(conda);
}

TEST(NcclLibrary, NowhereNamesTheCommandEveryPlaceTriedAndTheFix) {
  try {
    load_nccl({"/nonexistent/a/libnccl.so.2", "/nonexistent/b/libnccl.so.2"},
              "replay --backend nccl");
    FAIL() << "loaded a library that does not exist";
  } catch (const InputError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("replay --backend nccl needs NCCL, which was not found"), std::string::npos)
        << m;
    EXPECT_NE(m.find("/nonexistent/a/libnccl.so.2"), std::string::npos) << m;
    EXPECT_NE(m.find("/nonexistent/b/libnccl.so.2"), std::string::npos) << m;
    EXPECT_NE(m.find("LOSSGUARD_NCCL_LIBRARY"), std::string::npos) << m;
  }
}

TEST(NcclLibrary, LoadsTheWheelCopyOfAnEnvironmentAndItsSymbols) {
  // The machine's own NCCL (the CUDA toolkit's), placed where the nvidia-nccl wheel puts it.
  const fs::path system_copy = "/usr/local/cuda/lib/libnccl.so.2";
  if (!fs::exists(system_copy)) GTEST_SKIP() << "no " << system_copy << " on this machine";
  const fs::path venv = temp_dir("lossguard-nccl-load");
  fs::create_directories(wheel_copy(venv, "python3.11").parent_path());
  fs::create_symlink(system_copy, wheel_copy(venv, "python3.11"));
  std::vector<std::string> candidates =
      nccl_candidates("/nonexistent/libnccl.so.2", {venv.string()});
  candidates.erase(candidates.begin() +
                   1);  // not the loader's own path: the wheel copy must be the one found
  const NcclLibrary lib = load_nccl(candidates, "the test");
  EXPECT_EQ(lib.path, wheel_copy(venv, "python3.11").string());
  auto get_version = reinterpret_cast<int (*)(int*)>(nccl_symbol(lib, "ncclGetVersion"));
  int v = 0;
  EXPECT_EQ(get_version(&v), 0);
  EXPECT_GE(v, 20000) << "NCCL 2.x encodes its version as major*10000 + minor*100 + patch";
  EXPECT_THROW(nccl_symbol(lib, "ncclNoSuchFunction"), InputError);
  fs::remove_all(venv);
}

}  // namespace
}  // namespace lossguard
