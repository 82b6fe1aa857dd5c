// Helpers shared by the test binaries: temporary directories and files.
#pragma once
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <utility>

namespace lossguard::testing {

// A fresh directory for one test, removed with everything in it when the test ends (kept when
// LOSSGUARD_KEEP_TEST_DIRS is set, to look at what a failing test wrote). It is a path: `dir /
// "x"`.
class TempDir : public std::filesystem::path {
 public:
  explicit TempDir(std::filesystem::path p) : std::filesystem::path(std::move(p)) {
    std::filesystem::remove_all(*this);
    std::filesystem::create_directories(*this);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  TempDir(TempDir&& other) noexcept : std::filesystem::path(std::move(other)) { other.clear(); }
  ~TempDir() {
    if (empty() || std::getenv("LOSSGUARD_KEEP_TEST_DIRS") != nullptr) return;
    std::error_code ignored;
    std::filesystem::remove_all(*this, ignored);
  }
};

inline TempDir temp_dir(const std::string& name) {
  return TempDir(std::filesystem::temp_directory_path() /
                 ("lossguard-test-" + name + "-" + std::to_string(::getpid())));
}

inline void write_file(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

inline std::string fixture_dir() {
  const char* env = std::getenv("LOSSGUARD_FIXTURE_DIR");
  return env != nullptr ? env : LOSSGUARD_FIXTURE_DIR;
}

}  // namespace lossguard::testing
