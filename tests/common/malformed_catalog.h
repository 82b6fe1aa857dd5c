// A catalog of malformed and hostile dumps, each with the problem its error message must name. Used
// by the loader tests and by the CLI tests (every entry must exit 2, naming the file and the
// problem).
#pragma once
#include <filesystem>
#include <string>
#include <vector>

namespace lossguard::testing {

struct MalformedDump {
  std::string name;      // what is wrong, in words
  std::string path;      // the file written
  std::string expected;  // a substring the error message must contain
};

// Writes every entry into `dir` (committed hostile fixtures are referenced from `fixture_dir`).
std::vector<MalformedDump> write_malformed_catalog(const std::filesystem::path& dir,
                                                   const std::string& fixture_dir);

}  // namespace lossguard::testing
